"""Summing one bucket over a communicator through a compressor: what travels is the payload.

``CompressedSum(comm, compressor)(x, ctx, shapes)`` replaces the float32 host vector ``x`` (this
rank's gradient bucket) by the sum over ranks of what the compressor lets through, the same bytes on
every rank; error feedback keeps the rest per rank (with ``momentum`` > 0, momentum correction: the
ranks' velocities are summed). Collective over ``comm``: the world's, or hierarchical's cross-node one under
``compress_scope = inter`` (:mod:`.gradients` builds it). By the compressor's ``combine``:

  * "sum", float32 payloads (none, randk's values): ``MPI_Allreduce``;
  * "sum", 16-bit payloads (fp16, bf16): a ring over 16-bit messages with float32 accumulators (MPI
    has no half-precision sum); each hop re-rounds a partial sum, which error feedback cannot see, and
    the owner rounds its finished chunk once before the all-gather, so every rank decodes the same;
  * "gather" (topk, sign): every rank's payload, packed into one byte buffer of the same size on every
    rank, is all-gathered, decoded and added in rank order (the same rounding everywhere);
  * "lowrank" (PowerSGD): its two all-reduces per layer; ``shapes`` gives the bucket's layer shapes.

Per call, for the step metrics: ``sent_bytes`` (the payload bytes this rank sent; an all-reduce
counts 2 (p-1)/p of its size), ``dense_bytes`` (the same for the bucket uncompressed), ``encode_s``
and ``decode_s``.
"""

from __future__ import annotations

import time

import numpy as np

from .base import ErrorFeedback
from ..comm.ring import chunk_offsets

TAG = 0x43


class CompressedSum:
    def __init__(self, comm, compressor, momentum: float = 0.0):
        self.comm, self.size, self.rank = comm, comm.Get_size(), comm.Get_rank()
        self.c, self.momentum = compressor, momentum
        self.ef = ErrorFeedback(compressor, momentum)
        self.sent_bytes = self.dense_bytes = 0
        self.encode_s = self.decode_s = 0.0

    def __call__(self, x: np.ndarray, ctx, shapes=None) -> np.ndarray:
        x = x.reshape(-1)
        self.dense_bytes = self.allreduce_bytes(4 * x.size)
        if self.c.combine == "lowrank":
            return self._lowrank(x, ctx, shapes or [(x.size,)])
        self.encode_s = self.decode_s = 0.0
        t0 = time.perf_counter()
        payload = self.ef.step(x, ctx)
        self.encode_s = time.perf_counter() - t0
        if self.c.combine == "gather":
            total = self._gather(payload, x.size, ctx)
        else:
            total = self._sum(payload, x.size, ctx)
        x[:] = total
        return x

    # ---- "sum": payloads add -------------------------------------------------------
    def _sum(self, payload, n, ctx):
        summed = self._sum_payload(payload)
        t0 = time.perf_counter()
        if any(a.dtype == np.uint16 for a in payload.values()):
            out = self.c.decode(summed["values"])  # the ring's final 16-bit sums
        else:
            out = self.c.decompress(summed, n, ctx)
        self.decode_s += time.perf_counter() - t0
        return out

    def _sum_payload(self, payload) -> dict:
        """Each payload array summed over ranks: float32 arrays by ``MPI_Allreduce``, 16-bit
        ones by the ring (whose result is again 16-bit bits, the same on every rank)."""
        from mpi4py import MPI

        summed, self.sent_bytes = {}, 0
        for key, a in payload.items():
            if a.dtype == np.uint16:  # fp16 / bf16 bits
                summed[key] = self._ring16(a)
            else:
                a = np.ascontiguousarray(a, np.float32)
                if self.size > 1:
                    self.comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
                    self.sent_bytes += self.allreduce_bytes(a.nbytes)
                summed[key] = a
        return summed

    def _ring16(self, bits):
        """The 16-bit encoding of the sum over ranks of decode(bits), through 16-bit messages
        (see module doc); identical on every rank."""
        enc, dec = self._timed(self.c.encode, "encode_s"), self._timed(self.c.decode, "decode_s")
        p, r = self.size, self.rank
        if p == 1:
            return bits
        acc = dec(bits).copy()
        final = np.empty_like(bits)
        off = chunk_offsets(acc.size, p)
        right, left = (r + 1) % p, (r - 1) % p
        recv = np.empty(off[1] - off[0], np.uint16)
        for s in range(p - 1):  # reduce-scatter: partial sums travel as 16 bits
            cs, cr = (r - s) % p, (r - s - 1) % p
            n_r = off[cr + 1] - off[cr]
            out = enc(acc[off[cs]:off[cs + 1]])
            self.comm.Sendrecv(out, right, TAG, recv[:n_r], left, TAG)
            self.sent_bytes += out.nbytes
            acc[off[cr]:off[cr + 1]] += dec(recv[:n_r])
        mine = (r + 1) % p  # the finished chunk, rounded once, as every rank will see it
        final[off[mine]:off[mine + 1]] = enc(acc[off[mine]:off[mine + 1]])
        for s in range(p - 1):  # all-gather of the rounded chunks, forwarded as they came
            cs, cr = (r + 1 - s) % p, (r - s) % p
            out = final[off[cs]:off[cs + 1]]
            self.comm.Sendrecv(out, right, TAG, final[off[cr]:off[cr + 1]], left, TAG)
            self.sent_bytes += out.nbytes
        return final

    # ---- "gather": payloads are all-gathered and decoded one by one -----------------
    def _gather(self, payload, n, ctx):
        parts = self._allgather(payload)
        t0 = time.perf_counter()
        total = np.zeros(n, np.float32)
        for part in parts:  # rank order: the same additions on every rank
            self.c.add_sent(part, total, ctx)
        self.decode_s = time.perf_counter() - t0
        return total

    def _allgather(self, payload) -> list[dict]:
        """Every rank's payload, in rank order, as dicts of views into one received buffer."""
        # widest items first, so every array starts aligned to its item size in the buffer
        keys = sorted(payload, key=lambda k: (-np.asarray(payload[k]).dtype.itemsize, k))
        mine = np.concatenate([np.ascontiguousarray(payload[k]).reshape(-1).view(np.uint8) for k in keys])
        everyone = np.empty((self.size, mine.size), np.uint8)
        if self.size > 1:
            self.comm.Allgather(mine, everyone)
        else:
            everyone[0] = mine
        self.sent_bytes = mine.nbytes * (self.size - 1)  # a ring all-gather forwards p - 1 payloads
        parts = []
        for row in everyone:
            at, part = 0, {}
            for k in keys:
                a = payload[k]
                part[k] = row[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
                at += a.nbytes
            parts.append(part)
        return parts

    # ---- "lowrank": PowerSGD -----------------------------------------------------------
    def _lowrank(self, x, ctx, shapes):
        self.sent_bytes = 0
        comm_s = [0.0]
        allreduce_sum = self._allreduce_sum(comm_s)
        layers, at = [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            layers.append(x[at:at + size].reshape(shape))
            at += size
        if at != x.size:
            raise ValueError(f"layer shapes cover {at} elements, the bucket has {x.size}")
        t0 = time.perf_counter()
        out = self.c.reduce(layers, ctx, allreduce_sum, self.size, self.momentum)
        # the products and the QR: PowerSGD's whole compute, its two all-reduces taken out
        self.encode_s, self.decode_s = time.perf_counter() - t0 - comm_s[0], 0.0
        x[:] = np.concatenate([o.reshape(-1) for o in out])
        return x

    def _allreduce_sum(self, comm_s):
        """PowerSGD's ``allreduce_sum(a)``: a float32 host array summed in place; adds its
        bytes to ``sent_bytes`` and its time to ``comm_s[0]``."""
        from mpi4py import MPI

        def allreduce_sum(a):
            a = np.ascontiguousarray(a, np.float32)
            if self.size > 1:
                t = time.perf_counter()
                self.comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
                comm_s[0] += time.perf_counter() - t
                self.sent_bytes += self.allreduce_bytes(a.nbytes)
            return a
        return allreduce_sum

    def _timed(self, fn, counter):
        """``fn`` that adds its run time to the counter ``counter`` (the ring's 16-bit conversions)."""
        def run(a):
            t0 = time.perf_counter()
            out = fn(a)
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)
            return out
        return run

    def allreduce_bytes(self, nbytes: int) -> int:
        """Bytes per rank of a bandwidth-optimal all-reduce of ``nbytes``: 2 (p-1)/p of them."""
        return 2 * (self.size - 1) * nbytes // self.size

    def state(self) -> dict:
        """Per-rank compressor state for checkpoints (/compress)."""
        return self.c.state() if self.c.combine == "lowrank" else self.ef.state()

    def load_state(self, state: dict) -> None:
        (self.c if self.c.combine == "lowrank" else self.ef).load_state(state)

    def snapshot(self):
        """A copy of the per-rank state, for :meth:`restore` (the guard's skip)."""
        return {k: np.array(v, copy=True) for k, v in self.state().items()}

    def restore(self, snapshot) -> None:
        """The state :meth:`snapshot` copied (copied in again: ``load_state``'s arrays are its own)."""
        self.load_state(snapshot)

"""``hierarchical`` strategy: inside the node, then across nodes, then inside again.

  1. intra-node reduce-scatter: local rank c (c < L) ends with the node's sum of chunk c, by a
     ring over the node's communicator (not MPI's Reduce_scatter, which was slower: docs/dist.md);
  2. inter-node all-reduce: each local rank c < L all-reduces its chunk over ``cross_comm`` (the
     ranks with local rank c on every node), all in parallel, with the ``inner`` strategy;
  3. intra-node all-gather: a ring passes every chunk to every rank of the node.

So only 1/L of the buffer crosses the slow link per rank. Reductions run on the host copy. L is the
smallest node's size: local ranks >= L own an empty chunk, sit out phase 2 and get their node's
result in phase 3; chunk boundaries depend only on (n, L), so chunk c is the same elements on every
node. On one node the inner strategy runs directly. A buffer over ``segment_bytes`` runs in segments,
each through all three phases; with the ``mpi`` inner strategy a segment's phase 2 is a nonblocking
``Iallreduce`` that progresses while the node works on the next segment (:data:`PIPELINE_DEPTH`
pending). With ``compress_scope = "inter"`` phase 2 goes through a compressor, unsegmented.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from .flat import FLAT
from .halves import WholeSumHalves
from .reduce_ops import mpi_op, reduce_into, reduce_kind
from .ring import HostScratch, chunk_offsets, host_allreduce, host_halves
from .staging import Staging

TAG = 0x48
SEGMENT_BYTES = 512 << 10  # measured best on the emulated 1 Gbit/s cluster (docs/dist.md)
PIPELINE_DEPTH = 1  # segments whose cross-node step is still pending when the next one starts


class HierarchicalAllreduce(WholeSumHalves):
    """ZeRO's halves (:mod:`.halves`), on nodes of equal size: in the node and across, each a half of
    the all-reduce's (:meth:`reduce_scatter`); on one node the inner strategy's; on nodes of unequal
    size its whole sum, then MPI_Allgatherv (:class:`~.halves.WholeSumHalves`)."""

    def __init__(self, world, device, staging=None, inner: str = "mpi", segment_bytes: int = SEGMENT_BYTES):
        from mpi4py import MPI

        from ..device import CpuDevice

        if inner == "hierarchical":
            raise ValueError("the inner strategy of hierarchical must be flat (mpi, ring, rhd, naive)")
        self.world, self.device, self.comm = world, device, world.comm
        self.staging = staging or Staging(device)
        self.size = world.size
        # one agreed chunk count: the smallest node
        self.L = world.comm.allreduce(world.local_size, op=MPI.MIN)
        self.in_cross = world.local_rank < self.L
        self._inner = self._single_node = None
        if world.n_nodes == 1:
            self._single_node = FLAT[inner](world, device, self.staging)
        elif self.in_cross:
            cross = dataclasses.replace(world, comm=world.cross_comm, rank=world.cross_comm.Get_rank(),
                                        size=world.cross_comm.Get_size())
            # phase 2 works on host memory that staging already produced
            self._inner = FLAT[inner](cross, CpuDevice(device.dtype))
        self._recv = HostScratch()
        self.owned_chunk = chunk_rule(world, inner)
        self.native_halves = (getattr(self._single_node, "native_halves", False) if self._single_node
                              else equal_nodes(world))
        self.segment_bytes = segment_bytes
        self._nonblocking = inner == "mpi"
        # compress_scope = "inter": phase 2 sums through a compressor (compress_inter)
        self.cross_compressed = None
        self.compress_context = None
        self._compressing = False  # compress_inter was called (on every rank, also those outside phase 2)

    def compress_inter(self, make_sum):
        """Sum phase 2 (op sum only) through ``make_sum(cross_comm)``, a CompressedSum; the
        intra-node phases stay exact. The caller sets ``compress_context`` before each call
        (None: this call is not compressed, e.g. compression's warm-up). Compressed calls go
        unsegmented (error feedback keeps one residual per bucket chunk); the others keep the
        pipelined segments. Collective: every rank calls it."""
        if self.in_cross and self._single_node is None:
            self.cross_compressed = make_sum(self.world.cross_comm)
        self._compressing = True

    def __call__(self, buf, op="mean"):
        if self._single_node is not None:
            reduce_kind(op)  # the same ValueError as the multi-node path, before any MPI call
            return self._single_node(buf, op)
        return host_allreduce(self, buf, op, self._hierarchical)

    def _segments(self, buf, compressed: bool) -> list[int]:
        """Segment bounds of ``buf``: they depend only on its size and on whether the call is
        compressed (decided alike on every rank), so they agree on every rank."""
        seg_bytes = 0 if compressed else self.segment_bytes
        n_seg = max(1, -(-buf.nbytes // seg_bytes)) if seg_bytes > 0 else 1
        return chunk_offsets(buf.size, min(n_seg, max(1, buf.size)))

    def _hierarchical(self, flat, kind):
        compressed = self._compressing and kind == "sum" and self.compress_context is not None
        bounds = self._segments(flat, compressed)
        in_flight = collections.deque()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            seg = flat[lo:hi]
            offsets = self._offsets(seg.size)
            self._reduce_scatter(seg, offsets, kind)             # 1. in the node
            in_flight.append((seg, offsets, self._start_cross(seg, offsets, kind)))  # 2. across
            if len(in_flight) > PIPELINE_DEPTH:
                self._finish(*in_flight.popleft())
        while in_flight:
            self._finish(*in_flight.popleft())

    def cross_chunk(self, buf) -> int:
        """Elements of ``buf`` this rank sums across nodes in phase 2 of an uncompressed sum."""
        r, bounds = self.world.local_rank, self._segments(buf, compressed=False)
        return sum(off[r + 1] - off[r] for off in (self._offsets(hi - lo) for lo, hi in zip(bounds, bounds[1:])))

    def _offsets(self, n):
        # chunk c < L is local rank c's; ranks beyond the smallest node's size own nothing
        return chunk_offsets(n, self.L) + [n] * (self.world.local_size - self.L)

    def _start_cross(self, seg, offsets, kind):
        """Phase 2 for this rank's chunk of ``seg``: a pending request (mpi inner) or None (done)."""
        r = self.world.local_rank
        chunk = seg[offsets[r]:offsets[r + 1]]
        if self._inner is None or not chunk.size:
            return None
        if self.cross_compressed is not None and kind == "sum" and self.compress_context is not None:
            x = chunk.astype(np.float32)
            self.cross_compressed(x, self.compress_context)
            chunk[:] = x
            return None
        if self._nonblocking:
            from mpi4py import MPI
            return self.world.cross_comm.Iallreduce(MPI.IN_PLACE, chunk, op=mpi_op(kind))
        self._inner(chunk, kind)
        return None

    def _finish(self, seg, offsets, request):
        if request is not None:
            request.Wait()
        self._all_gather(seg, offsets)                           # 3. in the node

    # Ring phases over the node with rank c owning chunk c (chunks may be empty).
    def _reduce_scatter(self, x, off, kind):
        comm, p, r = self.world.local_comm, self.world.local_size, self.world.local_rank
        right, left = (r + 1) % p, (r - 1) % p
        recv = self._recv.get(x.dtype, max(off[i + 1] - off[i] for i in range(p)))
        # step s: pass on chunk r-s-1 (partly reduced), fold chunk r-s-2 from the
        # left into place; the last step delivers this rank's own chunk r
        for s in range(p - 1):
            c_send, c_recv = (r - s - 1) % p, (r - s - 2) % p
            n = off[c_recv + 1] - off[c_recv]
            comm.Sendrecv(x[off[c_send]:off[c_send + 1]], right, TAG, recv[:n], left, TAG)
            reduce_into(x[off[c_recv]:off[c_recv + 1]], recv[:n], kind)

    def _all_gather(self, x, off):
        comm, p, r = self.world.local_comm, self.world.local_size, self.world.local_rank
        right, left = (r + 1) % p, (r - 1) % p
        for s in range(p - 1):  # pass the finished chunks on, received straight into place
            c_send, c_recv = (r - s) % p, (r - s - 1) % p
            comm.Sendrecv(x[off[c_send]:off[c_send + 1]], right, TAG, x[off[c_recv]:off[c_recv + 1]], left, TAG)

    # ZeRO's halves. On nodes of L ranks each, chunk c * n_nodes + k of the size-way cut belongs to
    # local rank c, number k in its cross_comm (chunk_rule): local rank c's chunks are one contiguous
    # piece of the buffer, so the node's ring reduce-scatters pieces (phase 1 alone) and each cross_comm
    # reduce-scatters its piece into the chunks (MPI_Reduce_scatter); the all-gather runs the same
    # backwards. Per rank (L - 1)/L of the buffer inside the node, and (n_nodes - 1)/n_nodes of a
    # piece, 1/L of it, across: the all-reduce's traffic halved. Unsegmented (a bucket at a time).
    def reduce_scatter(self, buf):
        return self._half(buf, "reduce_scatter", self._scatter_pieces)

    def allgather(self, buf):
        return self._half(buf, "allgather", self._gather_pieces)

    def _half(self, buf, name, own):
        """Half ``name`` of ``buf``: the inner strategy's on one node, the whole sum's
        (WholeSumHalves) on nodes of unequal size, else ``own`` on the host copy."""
        if self._single_node is not None:
            return getattr(self._single_node, name)(buf)
        if not self.native_halves:
            return getattr(WholeSumHalves, name)(self, buf)
        return host_halves(self, buf, own)

    def _pieces(self, n):
        """(the node's L pieces' offsets, this rank's piece's chunks' offsets) of n elements."""
        nodes, c = self.world.n_nodes, self.world.local_rank
        off = chunk_offsets(n, self.size)
        return off[::nodes], off[c * nodes:(c + 1) * nodes + 1]

    def _scatter_pieces(self, x):
        from mpi4py import MPI

        pieces, chunks = self._pieces(x.size)
        self._reduce_scatter(x, pieces, "sum")
        counts = np.diff(chunks).tolist()
        k = self.world.cross_comm.Get_rank()
        recv = self._recv.get(x.dtype, counts[k])
        self.world.cross_comm.Reduce_scatter(x[chunks[0]:chunks[-1]], recv, recvcounts=counts, op=MPI.SUM)
        x[chunks[k]:chunks[k + 1]] = recv

    def _gather_pieces(self, x):
        from mpi4py import MPI

        pieces, chunks = self._pieces(x.size)
        counts = np.diff(chunks).tolist()
        displs = [c - chunks[0] for c in chunks[:-1]]
        self.world.cross_comm.Allgatherv(MPI.IN_PLACE, [x[chunks[0]:chunks[-1]], (counts, displs)])
        self._all_gather(x, pieces)


def equal_nodes(world) -> bool:
    """Whether ``world`` spans several nodes of one size (known from ``world.where``)."""
    if world.n_nodes < 2 or not world.where:
        return False
    sizes = collections.Counter(node for node, _ in world.where)
    return len(set(sizes.values())) == 1


def chunk_rule(world, inner: str = "mpi"):
    """``owned_chunk(rank, size)`` of hierarchical's ZeRO halves on ``world``: the inner strategy's on
    one node; on nodes of equal size local rank c, number k among the ranks of local rank c
    (its cross_comm rank: they are numbered in rank order), owns chunk c * n_nodes + k; else
    chunk ``rank`` (the whole sum's). Local: from ``world.where``."""
    if world.n_nodes == 1:
        return FLAT[inner].owned_chunk
    if not equal_nodes(world):
        return WholeSumHalves.owned_chunk
    owner, seen = [], collections.Counter()
    for _, local in world.where:
        owner.append(local * world.n_nodes + seen[local])
        seen[local] += 1
    return lambda rank, size: owner[rank]

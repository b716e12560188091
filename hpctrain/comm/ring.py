"""``ring`` strategy: reduce-scatter then all-gather around a ring of ranks.

The buffer (N elements) is split into ``size`` chunks, the first ``N % size``
one element longer (chunks may be empty when N < size). In ``size - 1`` steps
each rank sends one chunk to its right neighbour and reduces the chunk from its
left into place; then ``size - 1`` more steps pass the finished chunks around.
Every rank sends 2 N (size-1)/size elements whatever the world size (bandwidth
optimal), in 2 (size-1) messages (latency grows with the world).

Each element is reduced by one rank and then copied, so every rank ends with
the same bytes. Reductions run on the host (``Staging.host_view``) with the
compiled :func:`~hpctrain.comm.reduce_ops.reduce_into`.
"""

import numpy as np

from .reduce_ops import reduce_into, reduce_kind
from .staging import Staging

TAG = 0x52  # one tag: messages between a pair of ranks arrive in the order sent


def chunk_start(n: int, parts: int, i: int) -> int:
    """Where chunk ``i`` of ``n`` elements split into ``parts`` chunks starts (the first n % parts
    chunks one element longer); ``i = parts`` gives n."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra)


def chunk_offsets(n: int, parts: int) -> list[int]:
    """Offsets (parts + 1) of ``n`` elements split into ``parts`` chunks, the first n % parts longer."""
    return [chunk_start(n, parts, i) for i in range(parts + 1)]


class HostScratch:
    """Receive buffers in host memory, one per dtype, grown on demand and reused across calls."""

    def __init__(self):
        self._bufs: dict = {}

    def get(self, dtype, n: int):
        buf = self._bufs.get(np.dtype(dtype).str)
        if buf is None or buf.size < n:
            buf = self._bufs[np.dtype(dtype).str] = np.empty(n, dtype=dtype)
        return buf[:n]


def flat_host(host):
    """The 1-D view of a contiguous host array (a copy would lose the results)."""
    if not host.flags.c_contiguous:
        raise ValueError("all-reduce buffers must be contiguous: pass the flat buffer or a slice of it")
    return host.reshape(-1)


def host_allreduce(strategy, buf, op, algorithm):
    """The frame of every strategy that reduces on the host (ring, rhd, hierarchical).

    Validates ``op`` before any MPI call, skips 1-rank worlds and empty
    buffers (every rank makes the same choice), runs ``algorithm(x, kind)`` on
    the flat host view from ``strategy.staging.host_view`` (kind: sum, max or
    min), then applies mean's one scale to the device buffer. ``strategy``
    provides ``size``, ``staging`` and ``device``.
    """
    kind = reduce_kind(op)  # unknown ops fail here, before any MPI call
    if strategy.size == 1 or buf.size == 0:
        return buf  # nothing to exchange; the mean of one rank is itself
    with strategy.staging.host_view(buf) as host:
        algorithm(flat_host(host), kind)
    if op == "mean":
        strategy.device.ops.scale(buf, 1.0 / strategy.size)
    return buf


def host_halves(strategy, buf, half):
    """The frame of ZeRO's halves (:mod:`.halves`): ``half(x)`` on the flat host view of ``buf``
    (staging slot "zero"); nothing for one rank or an empty buffer."""
    if strategy.size > 1 and buf.size:
        with strategy.staging.host_view(buf, slot="zero") as host:
            half(flat_host(host))
    return buf


class RingAllreduce:
    """Collective over ``world.comm``: every rank calls it with a buffer of one size and dtype."""

    def __init__(self, world, device, staging=None):
        self.comm, self.rank, self.size, self.device = world.comm, world.rank, world.size, device
        self.staging = staging or Staging(device)
        self.scratch = HostScratch()

    def __call__(self, buf, op="mean"):
        """Reduce ``buf`` in place over all ranks (op: sum, mean, max, min); returns ``buf``."""
        return host_allreduce(self, buf, op, self._ring)

    def _ring(self, x, kind):
        self._reduce_scatter(x, kind)
        self._allgather(x)

    # ZeRO's halves (hpctrain.comm.halves): the ring's own, so a zero-1 step sums in the same order
    native_halves = True

    @staticmethod
    def owned_chunk(rank: int, size: int) -> int:
        return (rank + 1) % size  # where the reduce-scatter leaves the finished sum

    def reduce_scatter(self, buf):
        return host_halves(self, buf, lambda x: self._reduce_scatter(x, "sum"))

    def allgather(self, buf):
        return host_halves(self, buf, self._allgather)

    def _reduce_scatter(self, x, kind):
        p, r, comm = self.size, self.rank, self.comm
        off = chunk_offsets(x.size, p)
        right, left = (r + 1) % p, (r - 1) % p
        recv = self.scratch.get(x.dtype, off[1] - off[0])  # chunk 0 is the longest
        # at step s, send chunk r-s and fold chunk r-s-1 from the left into place;
        # after size-1 steps chunk r+1 holds every rank's contribution
        for s in range(p - 1):
            c_send, c_recv = (r - s) % p, (r - s - 1) % p
            n_recv = off[c_recv + 1] - off[c_recv]
            comm.Sendrecv(x[off[c_send]:off[c_send + 1]], right, TAG, recv[:n_recv], left, TAG)
            reduce_into(x[off[c_recv]:off[c_recv + 1]], recv[:n_recv], kind)

    def _allgather(self, x):
        p, r, comm = self.size, self.rank, self.comm
        off = chunk_offsets(x.size, p)
        right, left = (r + 1) % p, (r - 1) % p
        # pass the finished chunks on (chunk r+1 first), received straight into place
        for s in range(p - 1):
            c_send, c_recv = (r + 1 - s) % p, (r - s) % p
            comm.Sendrecv(x[off[c_send]:off[c_send + 1]], right, TAG,
                          x[off[c_recv]:off[c_recv + 1]], left, TAG)

"""``rhd`` strategy: recursive halving-doubling (Rabenseifner's algorithm).

With p2 the largest power of two <= size: a reduce-scatter by recursive
halving (log2 p2 exchanges of N/2, N/4, ... elements) leaves each rank one
fully reduced chunk of N/p2; an all-gather by recursive doubling (the same
exchanges in reverse) gives everyone everything. Bandwidth like the ring's,
but 2 log2(p2) messages instead of 2 (size-1): better for small and mid-sized
buffers and larger worlds.

Non-powers of two: the first 2*(size-p2) ranks pair up; each even rank of a
pair folds its whole buffer into its odd partner and sits out, then receives
the finished result at the end (one extra N-element hop each way).

Each element is reduced by one rank and then copied, so every rank ends with
the same bytes. Reductions run on the host (``Staging.host_view``).
"""

from .halves import WholeSumHalves
from .reduce_ops import reduce_into
from .ring import HostScratch, chunk_offsets, host_allreduce, host_halves
from .staging import Staging

TAG = 0x48


class RhdAllreduce(WholeSumHalves):
    """Collective over ``world.comm``: every rank calls it with a buffer of one size and dtype.
    ZeRO's halves: its own at a power of two, else :class:`~.halves.WholeSumHalves`'s."""

    def __init__(self, world, device, staging=None):
        self.comm, self.rank, self.size, self.device = world.comm, world.rank, world.size, device
        self.staging = staging or Staging(device)
        self.scratch = HostScratch()
        self.p2 = 1 << (self.size.bit_length() - 1)  # largest power of two <= size
        self.rem = self.size - self.p2                 # ranks folded in by the pre-step

    def __call__(self, buf, op="mean"):
        """Reduce ``buf`` in place over all ranks (op: sum, mean, max, min); returns ``buf``."""
        return host_allreduce(self, buf, op, self._rhd)

    def _real_rank(self, v: int) -> int:
        """World rank of the rank numbered ``v`` among the p2 that take part in the halving."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    # ZeRO's halves (hpctrain.comm.halves): at a power of two the halving and the doubling alone (the
    # same additions as the all-reduce, half its traffic each), chunk ``rank`` of the ring's cut; with
    # ranks folded in, the whole sum and MPI_Allgatherv (WholeSumHalves), which own the same chunks
    def reduce_scatter(self, buf):
        if self.rem:
            return WholeSumHalves.reduce_scatter(self, buf)
        return host_halves(self, buf, lambda x: self._halving(x, "sum", self.rank))

    def allgather(self, buf):
        if self.rem:
            return WholeSumHalves.allgather(self, buf)
        return host_halves(self, buf, lambda x: self._doubling(x, self.rank, self.rank, self.rank + 1))

    def _rhd(self, x, kind):
        r, comm, rem = self.rank, self.comm, self.rem
        # pre-step (non-powers of two): even ranks below 2*rem hand their data to
        # the odd rank above, then wait for the result (the post-step below)
        if r < 2 * rem:
            if r % 2 == 0:
                comm.Send(x, r + 1, TAG)
                comm.Recv(x, r + 1, TAG)
                return
            scratch = self.scratch.get(x.dtype, x.size)
            comm.Recv(scratch, r - 1, TAG)
            reduce_into(x, scratch, kind)
        v = r // 2 if r < 2 * rem else r - rem  # this rank's number among the p2
        self._doubling(x, v, *self._halving(x, kind, v))
        # post-step: the odd rank of a folded pair sends the result to its even partner
        if r < 2 * rem:
            comm.Send(x, r - 1, TAG)

    def _halving(self, x, kind, v):
        """Reduce-scatter by recursive halving among the p2 (``v``: this rank's number there): at
        distance d the partner v^d shares our chunk range [lo, hi); we keep the half on our side of
        bit d, send the other half and fold the partner's copy of ours. Returns (lo, hi) = (v, v+1)."""
        p2, comm = self.p2, self.comm
        off = chunk_offsets(x.size, p2)
        scratch = self.scratch.get(x.dtype, off[p2 // 2])  # the largest receive: the first (lower) half
        lo, hi, d = 0, p2, p2 // 2
        while d:
            partner, mid = self._real_rank(v ^ d), (lo + hi) // 2
            (klo, khi), (glo, ghi) = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
            recv = scratch[:off[khi] - off[klo]]
            comm.Sendrecv(x[off[glo]:off[ghi]], partner, TAG, recv, partner, TAG)
            reduce_into(x[off[klo]:off[khi]], recv, kind)
            lo, hi, d = klo, khi, d // 2
        return lo, hi

    def _doubling(self, x, v, lo, hi):
        """All-gather by recursive doubling among the p2: at distance d the partner holds the finished
        range next to ours, of the same width; swap them, received in place."""
        p2, comm = self.p2, self.comm
        off = chunk_offsets(x.size, p2)
        d = 1
        while d < p2:
            partner, width = self._real_rank(v ^ d), hi - lo
            olo, ohi = (lo - width, lo) if v & d else (hi, hi + width)
            comm.Sendrecv(x[off[lo]:off[hi]], partner, TAG, x[off[olo]:off[ohi]], partner, TAG)
            lo, hi, d = min(lo, olo), max(hi, ohi), d * 2

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
    ZeRO's halves: its own at every size (only ``owned_chunk`` is :class:`~.halves.WholeSumHalves`')."""

    native_halves = True

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

    # ZeRO's halves (hpctrain.comm.halves), chunk ``rank`` of the ring's cut: the all-reduce's halving
    # and doubling alone (half its traffic on the p2). With ranks folded in, the halving's ranges are
    # whole chunks of the size-way cut (the folded pair's two chunks are its range), the odd rank of
    # a pair hands the even one its chunk, and the all-gather ends with the whole buffer sent back:
    # the same additions as the all-reduce (each element's tree of partial sums is the same
    # whichever range holds it), so ZeRO on rhd gives zero 0's bits at every size.
    def reduce_scatter(self, buf):
        return host_halves(self, buf, self._reduce_scatter)

    def allgather(self, buf):
        return host_halves(self, buf, self._allgather)

    def _groups(self, n: int) -> list[int]:
        """Offsets (p2 + 1) of the halving's ranges: number v's range is the chunks of the ranks
        it stands for (2v and 2v + 1 for a folded pair, else v + rem) in the size-way cut of n."""
        off = chunk_offsets(n, self.size)
        return [off[2 * v if v < self.rem else v + self.rem] for v in range(self.p2)] + [n]

    def _reduce_scatter(self, x):
        r, comm, rem = self.rank, self.comm, self.rem
        own = chunk_offsets(x.size, self.size)[r:r + 2]
        if r < 2 * rem and r % 2 == 0:  # folded in: the partner sums for both, then hands this chunk back
            comm.Send(x, r + 1, TAG)
            comm.Recv(x[own[0]:own[1]], r + 1, TAG)
            return
        if r < 2 * rem:
            scratch = self.scratch.get(x.dtype, x.size)
            comm.Recv(scratch, r - 1, TAG)
            reduce_into(x, scratch, "sum")
        v = r // 2 if r < 2 * rem else r - rem
        self._halving(x, "sum", v, self._groups(x.size))
        if r < 2 * rem:
            partner = chunk_offsets(x.size, self.size)[r - 1:r + 1]
            comm.Send(x[partner[0]:partner[1]], r - 1, TAG)

    def _allgather(self, x):
        r, comm, rem = self.rank, self.comm, self.rem
        off = chunk_offsets(x.size, self.size)
        if r < 2 * rem and r % 2 == 0:  # hand this chunk to the partner, receive the whole buffer
            comm.Send(x[off[r]:off[r + 1]], r + 1, TAG)
            comm.Recv(x, r + 1, TAG)
            return
        if r < 2 * rem:
            comm.Recv(x[off[r - 1]:off[r]], r - 1, TAG)
        v = r // 2 if r < 2 * rem else r - rem
        self._doubling(x, v, v, v + 1, self._groups(x.size))
        if r < 2 * rem:
            comm.Send(x, r - 1, TAG)

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

    def _halving(self, x, kind, v, off=None):
        """Reduce-scatter by recursive halving among the p2 (``v``: this rank's number there): at
        distance d the partner v^d shares our range of chunks [lo, hi); we keep the half on our side
        of bit d, send the other half and fold the partner's copy of ours. Returns (lo, hi) =
        (v, v+1). ``off``: the p2 chunks' offsets (default: the p2-way cut of x)."""
        p2, comm = self.p2, self.comm
        off = off or chunk_offsets(x.size, p2)
        scratch = self.scratch.get(x.dtype, max(off[p2 // 2], x.size - off[p2 // 2]))  # the larger half
        lo, hi, d = 0, p2, p2 // 2
        while d:
            partner, mid = self._real_rank(v ^ d), (lo + hi) // 2
            (klo, khi), (glo, ghi) = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
            recv = scratch[:off[khi] - off[klo]]
            comm.Sendrecv(x[off[glo]:off[ghi]], partner, TAG, recv, partner, TAG)
            reduce_into(x[off[klo]:off[khi]], recv, kind)
            lo, hi, d = klo, khi, d // 2
        return lo, hi

    def _doubling(self, x, v, lo, hi, off=None):
        """All-gather by recursive doubling among the p2: at distance d the partner holds the finished
        range of chunks next to ours, as many; swap them, received in place. ``off`` as _halving's."""
        p2, comm = self.p2, self.comm
        off = off or chunk_offsets(x.size, p2)
        d = 1
        while d < p2:
            partner, width = self._real_rank(v ^ d), hi - lo
            olo, ohi = (lo - width, lo) if v & d else (hi, hi + width)
            comm.Sendrecv(x[off[lo]:off[hi]], partner, TAG, x[off[olo]:off[ohi]], partner, TAG)
            lo, hi, d = min(lo, olo), max(hi, ohi), d * 2

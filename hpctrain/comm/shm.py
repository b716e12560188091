"""``shm`` strategy: the ranks of one machine reduce through memory they all map, no messages.

An *arena* is an MPI shared window (``MPI_Win_allocate_shared``) of p slots of n elements, slot j
rank j's. Reducing elements [a, b) of every slot: agree (one small all-reduce, which is also the
barrier after which every rank's data is in place), then rank r folds the r-th 1/p of [a, b) over
the slots in slot order and writes the result into every slot, then a barrier. Every element is
reduced once, by one rank, in one order, so every rank ends with the same bytes.

Zero copy: :meth:`ShmAllreduce.allocate` (collective) returns this rank's slot of a new arena; the
trainer keeps its CPU gradient buffer there, and a slice of it is reduced in place (``sum_scaled``
scales and tests for NaN/Inf inside the fold, each rank its own share). Ranks must pass the same
slice; a mismatch raises ValueError on every rank. Any other buffer is copied through a scratch
arena of ``segment_bytes`` per slot. Every rank must share one machine; elsewhere construction
raises :class:`~hpctrain.errors.LaunchError` on every rank (use ``hierarchical``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..errors import LaunchError
from .halves import WholeSumHalves
from .reduce_ops import _max_into, _min_into, _sum_into, scale_and_test
from .ring import chunk_start, host_allreduce
from .staging import Staging

SEGMENT_BYTES = 4 << 20  # scratch arena per slot, for buffers outside an arena


MAX_REMEMBERED_SLICES = 256  # window slices whose place _window_slice remembers (bucket views)
TILE = 2048  # elements folded at a time: the tile stays in L1 while every slot's piece is read


@njit(cache=True, nogil=True)
def _copy_into(dst, src):
    for i in range(dst.size):
        dst[i] = src[i]


@njit(cache=True, nogil=True)
def _scale_into(dst, factor):
    for i in range(dst.size):
        dst[i] *= factor


@njit(cache=True, nogil=True)
def _all_finite(x):
    bad = False
    for i in range(x.size):
        v = x[i]
        bad |= v - v != 0  # NaN for +-Inf and NaN, 0 otherwise: an OR the compiler vectorises
    return not bad


@njit(cache=True, nogil=True)
def _fold(slots, lo, hi, kind, factor, check, only):
    """slots[:, lo:hi] = reduction over the rows, in row order; kind 0 sum, 1 max, 2 min (NaN wins).
    ``only`` >= 0: the result goes to rows 0 and ``only`` (a reduce-scatter's: the others keep
    their values); -1: to every row.
    With kind 0 the sums are then multiplied by ``factor`` (of the slots' dtype) unless it is 1,
    and with ``check`` the result is tested for NaN/Inf; returns False if one was found.

    Tile by tile: the p pieces of a tile are folded into the first row's piece,
    scaled and tested, then copied to the other rows while still in cache, so
    memory sees each element read once and written once per row (a separate
    scale pass and finiteness test afterwards read the whole bucket twice more:
    20 us of a 0.44 ms step for the small model at 2 ranks, with the Python
    around them). The loops run over zero-based views of each tile (the
    reduce_ops kernels): indexing the rows at ``lo + i`` instead made numba
    check every index for wrap-around, which kept the loop from vectorising
    (5x slower: 131 us against 26 us for 4 x 64 K float32 here)."""
    p = slots.shape[0]
    finite = True
    for t in range(lo, hi, TILE):
        e = min(hi, t + TILE)
        out = slots[0, t:e]
        for j in range(1, p):
            if kind == 0:
                _sum_into(out, slots[j, t:e])
            elif kind == 1:
                _max_into(out, slots[j, t:e])
            else:
                _min_into(out, slots[j, t:e])
        if kind == 0 and factor != 1:
            _scale_into(out, factor)
        if check and finite:
            finite = _all_finite(out)
        if only < 0:
            for j in range(1, p):
                _copy_into(slots[j, t:e], out)
        elif only > 0:
            _copy_into(slots[only, t:e], out)
    return finite


_KIND = {"sum": 0, "max": 1, "min": 2}


class _Arena:
    """p slots of ``n`` elements of ``dtype`` in one shared window. Collective to make and to free."""

    def __init__(self, comm, n: int, dtype):
        from mpi4py import MPI

        p, self.dtype = comm.Get_size(), np.dtype(dtype)
        nbytes = max(1, p * n * self.dtype.itemsize)
        self.win = MPI.Win.Allocate_shared(nbytes if comm.Get_rank() == 0 else 0, 1, comm=comm)
        mem, _ = self.win.Shared_query(0)
        self.slots = np.frombuffer(mem, dtype=self.dtype, count=p * n).reshape(p, n)
        self.win.Lock_all()  # one passive epoch for the arena's life; Sync() orders the accesses
        self.mine = self.slots[comm.Get_rank()]

    def offset_of(self, x):
        """Element offset of ``x`` in this rank's slot, or None if ``x`` is not a slice of it."""
        if x.dtype != self.dtype or self.mine.size == 0 or not x.flags.c_contiguous:
            return None
        start = self.mine.__array_interface__["data"][0]
        at = x.__array_interface__["data"][0] - start
        if 0 <= at and at + x.nbytes <= self.mine.nbytes and at % x.itemsize == 0:
            return at // x.itemsize
        return None

    def free(self):
        self.win.Unlock_all()
        self.win.Free()


class ShmAllreduce(WholeSumHalves):
    """Collective over ``world.comm`` (all on one machine): buffers of one size and dtype.
    ZeRO's halves: its fold alone in a window (:meth:`reduce_scatter`), else the whole sum; the
    all-gather MPI_Allgatherv (:class:`~.halves.WholeSumHalves`)."""

    def __init__(self, world, device, staging=None, segment_bytes: int = SEGMENT_BYTES):
        from mpi4py import MPI

        self.comm, self.rank, self.size, self.device = world.comm, world.rank, world.size, device
        self.staging = staging or Staging(device)
        node = world.comm.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
        together = node.Get_size() == world.size
        if not together:
            node.Free()
            raise LaunchError("dist.allreduce = 'shm' needs every rank on one machine; across nodes use "
                              "hierarchical (or mpi, ring, rhd)")
        # windows are made on this communicator: world.comm's ranks in world.comm's order
        # (key = rank), always a real MPI communicator (world.comm may be a wrapper)
        self._node = node
        self.segment_bytes = max(64, segment_bytes)
        self.arenas: list[_Arena] = []
        self._scratch: dict = {}  # dtype -> arena of segment_bytes per slot
        self._slices: dict = {}   # id(array) -> (array, (arena index, offset)): see _window_slice
        self._agreement = np.zeros(6, np.int64)
        self._in_place, self._max = MPI.IN_PLACE, MPI.MAX

    def allocate(self, n: int, dtype) -> np.ndarray:
        """This rank's slot (zeroed) of a new arena of ``n`` elements per rank. Collective.

        Slices of the returned array are all-reduced without copies."""
        arena = _Arena(self._node, n, dtype)
        self.arenas.append(arena)
        arena.mine[:] = 0
        return arena.mine

    def holds(self, buf) -> bool:
        """Whether ``buf`` is a slice of one of this rank's slots from :meth:`allocate` (reduced without copies)."""
        return self._window_slice(buf) is not None

    def release(self, slot) -> None:
        """Free the arena whose slot :meth:`allocate` returned as ``slot``. Collective; ``slot`` becomes invalid."""
        arena = next(a for a in self.arenas if a.mine is slot)
        self.arenas.remove(arena)
        self._slices.clear()  # arena indices moved
        arena.free()

    def __call__(self, buf, op="mean"):
        """Reduce ``buf`` in place over all ranks (op: sum, mean, max, min); returns ``buf``."""
        where = self._window_slice(buf) if op == "mean" and self.size > 1 and buf.size else None
        if where is None:
            return host_allreduce(self, buf, op, self._reduce)
        self._fold_in_window(buf, where, 1.0 / self.size, False)  # mean's one scale, inside the fold
        return buf

    def reduce_scatter(self, buf):
        """ZeRO's reduce-scatter (:mod:`.halves`): for a slice of a window from :meth:`allocate`, the
        fold alone, each rank writing its share (chunk ``rank``, the ring's cut) of the sum to its own
        slot only: the same sums as an all-reduce, 1/p of its writes. Elsewhere the whole sum
        (:class:`~.halves.WholeSumHalves`). Collective."""
        where = self._window_slice(buf) if self.size > 1 and buf.size else None
        if where is None:
            return WholeSumHalves.reduce_scatter(self, buf)
        index, at = where
        self._fold(self.arenas[index], index, at, buf.size, "sum", only=self.rank)
        return buf

    def sum_scaled(self, buf, factor: float, check_finite: bool = False) -> bool:
        """``buf`` summed over ranks in place, then multiplied by ``factor`` rounded to its dtype:
        the bits of ``self(buf, "sum")`` followed by ``kernels.scale`` (the averaging of gradient
        buckets). With ``check_finite``, returns False if this rank found a NaN or Inf in the
        result (True otherwise, and always True without the check). Collective.

        On a slice of a window from :meth:`allocate` the multiply and the test happen inside the
        fold, without more passes over the buffer, and each rank tests only the share it folded:
        the ranks' answers together cover the buffer (some rank answers False exactly when an
        element is not finite), so callers must combine them, as the trainer's step statistics
        do. Elsewhere each rank tests the whole buffer."""
        where = self._window_slice(buf) if self.size > 1 and buf.size else None
        if where is None:
            self(buf, "sum")
            return scale_and_test(buf, factor, self.device, check_finite)
        return self._fold_in_window(buf, where, factor, check_finite)

    def _fold_in_window(self, buf, where, factor: float, check: bool) -> bool:
        """Sum of the window slice ``buf`` at ``where`` (from :meth:`_window_slice`), scaled and
        tested inside the fold (see :meth:`sum_scaled`). Collective."""
        index, at = where
        return self._fold(self.arenas[index], index, at, buf.size, "sum", buf.dtype.type(factor), check)

    def _window_slice(self, x):
        """(arena index, element offset) of ``x`` in this rank's slots, or None. Found slices are
        remembered per array object (the trainer passes the same bucket views every step; the
        search reads ``__array_interface__`` per arena, some us each on a cold cache); the entry
        keeps ``x`` itself, so its id cannot be reused by another array while it is there."""
        hit = self._slices.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        if not isinstance(x, np.ndarray):  # a device buffer: never in a window
            return None
        for i, arena in enumerate(self.arenas):
            at = arena.offset_of(x)
            if at is not None:
                if len(self._slices) >= MAX_REMEMBERED_SLICES:
                    self._slices.clear()
                self._slices[id(x)] = (x, (i, at))
                return i, at
        return None

    def _reduce(self, x, kind):
        where = self._window_slice(x)
        if where is not None:
            self._fold(self.arenas[where[0]], where[0], where[1], x.size, kind)
            return
        key = np.dtype(x.dtype).str
        if key not in self._scratch:  # making it is collective: every rank must be here too
            self._agree(-1, 0, x.size)
            self._scratch[key] = _Arena(self._node, self.segment_bytes // x.itemsize, x.dtype)
        scratch = self._scratch[key]
        per = scratch.mine.size
        for lo in range(0, x.size, per):
            seg = x[lo:lo + per]
            scratch.mine[:seg.size] = seg
            self._fold(scratch, -2, 0, seg.size, kind)
            seg[:] = scratch.mine[:seg.size]

    def _agree(self, key, at, n):
        """Every rank passed the same (arena key, offset, length), or ValueError on every rank.
        Collective; also the barrier before a fold."""
        mine = self._agreement
        mine[:] = key, at, n, -key, -at, -n
        self.comm.Allreduce(self._in_place, mine, op=self._max)
        if mine[0] != -mine[3] or mine[1] != -mine[4] or mine[2] != -mine[5]:
            raise ValueError("shm all-reduce: ranks passed different buffers (an arena slice on some "
                             "ranks, another slice or a plain buffer on others); every rank must reduce "
                             "the same slice of its allocate()d buffer, or plain buffers everywhere")

    def _fold(self, arena, key, at, n, kind, factor=None, check=False, only=-1) -> bool:
        """Fold [at, at + n) of the arena's slots over ranks, between two synchronisations; a sum
        is multiplied by ``factor`` (of the arena's dtype) unless it is None. Returns False if
        ``check`` found a NaN/Inf in this rank's share of the result. ``only`` = this rank: each
        rank's share of the result goes to its own slot only (ZeRO's reduce-scatter). Collective."""
        arena.win.Sync()             # this rank's stores to its slot are visible ...
        self._agree(key, at, n)      # ... to every rank past this point
        arena.win.Sync()
        lo, hi = at + chunk_start(n, self.size, self.rank), at + chunk_start(n, self.size, self.rank + 1)
        finite = _fold(arena.slots, lo, hi, _KIND[kind], arena.dtype.type(1) if factor is None else factor, check,
                       only)
        arena.win.Sync()
        self.comm.Barrier()          # every fold is done before any rank reads or rewrites its slot
        arena.win.Sync()
        return finite

    def close(self):
        """Free every arena (collective); buffers from :meth:`allocate` become invalid."""
        for arena in self.arenas + list(self._scratch.values()):
            arena.free()
        self.arenas, self._scratch = [], {}
        self._slices.clear()
        if self._node is not None:
            self._node.Free()
            self._node = None

"""Which rows (samples or token windows) each rank reads at each global step.

Sampling rule: epoch e uses the permutation ``default_rng([seed, e])`` of
0..N-1, identical on every rank. Step s of the epoch takes the global batch
``perm[s*G:(s+1)*G]`` (G = global batch); rank r takes its share of it, the
contiguous rows ``shard_range(G, r, size)``: b = G / size rows each when the
world size divides G, else shares that differ by at most one row (the first
G mod size ranks take one more; the trainer then weights each rank's gradient
by its share, so the average is still the whole batch's). The last partial batch (N mod G samples) is
dropped; since each epoch reshuffles, different samples are dropped each time.
The position is a pure function of the global step, so resuming needs only
the step. The same rule serves the tabular rows and the token windows
(:mod:`.tokens`), so N ranks read exactly the rows one rank with the N-times
batch would.
"""

from __future__ import annotations

import numpy as np

from ..errors import DataError, LaunchError


def per_rank_batch(global_batch: int, world_size: int) -> int:
    """b = G / world size, or a :class:`LaunchError` that says which sizes would work."""
    if global_batch % world_size:
        lower = global_batch - global_batch % world_size
        near = " or ".join(str(g) for g in sorted({lower, lower + world_size} - {0}))
        raise LaunchError(f"train.global_batch={global_batch} is not divisible by the world size {world_size}; "
                          f"use a multiple of {world_size} (e.g. --set train.global_batch={near}) "
                          f"or launch a number of ranks that divides {global_batch}")
    return global_batch // world_size


class DistributedSampler:
    """Which rows rank ``rank`` of ``size`` reads at each global step (see module docstring).

    ``batch`` is this rank's share (rows per step), ``offset`` where it starts in the global
    batch, ``even`` whether every rank has the same share. ``exact`` refuses a world size that
    does not divide the global batch (``train.exact_shares``) instead of sharing it unevenly.
    """

    def __init__(self, n: int, global_batch: int, rank: int, size: int, seed: int, exact: bool = False):
        if n < global_batch:
            raise DataError(f"the dataset has {n} samples, fewer than one global batch ({global_batch}); "
                            f"lower train.global_batch or use more data")
        if exact:
            per_rank_batch(global_batch, size)
        if global_batch < size:
            raise LaunchError(f"train.global_batch={global_batch} is smaller than the world size {size}: some "
                              f"ranks would have no rows; use at least {size} or launch fewer ranks")
        self.n, self.global_batch, self.rank, self.seed = n, global_batch, rank, seed
        lo, hi = shard_range(global_batch, rank, size)
        self.offset, self.batch, self.even = lo, hi - lo, global_batch % size == 0
        self.steps_per_epoch = n // global_batch
        self._perm_epoch, self._perm = None, None

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within epoch) of a 0-based global step."""
        return divmod(step, self.steps_per_epoch)

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perm_epoch = epoch
        return self._perm

    def indices(self, step: int) -> np.ndarray:
        """This rank's ``batch`` row indices for global ``step``, in permutation order."""
        epoch, s = self.position(step)
        start = s * self.global_batch + self.offset
        return self.permutation(epoch)[start:start + self.batch]


def shard_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous [start, stop) of n rows for ``rank`` (sizes differ by at most 1), for evaluation."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)

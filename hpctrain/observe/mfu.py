"""Model FLOPs utilisation: the machine's GEMM peak, measured once at start-up.

MFU = model FLOPs per second (the model's own count of one row's forward and backward, times rows
per second) / the peak. The peak (:func:`world_peak_flops`, called by the trainer at start-up;
collective over its world) is what this machine's BLAS reaches on a PEAK_N^3 GEMM in the compute
dtype, best of PEAK_REPEATS, measured on every rank at once (ranks sharing cores measure their share)
and summed over ranks; once per process and group of ranks. It is the BLAS the CPU kernels use, so
100 % is the GEMMs alone at full speed; attention's softmax, LayerNorm and the rest count as
overhead. On a GPU no peak is measured (None: no MFU).
"""

from __future__ import annotations

import time

import numpy as np

PEAK_N = 1024     # 2 GFLOP per product: long enough to reach the BLAS's steady rate, ~0.1 s on one core
PEAK_REPEATS = 3  # the best of 3 timed products after one warm-up


def gemm_peak_flops(dtype, n: int = PEAK_N, repeats: int = PEAK_REPEATS) -> float:
    """FLOP/s of an (n x n) @ (n x n) product in ``dtype`` on this process's BLAS threads (best of ``repeats``)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    np.matmul(a, b, out=c)  # warm-up: threads started, pages touched
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


_MEASURED: dict = {}  # (dtype, the world ranks of the communicator) -> its peak, once per process


def world_peak_flops(world, device) -> float | None:
    """The sum over ranks of :func:`gemm_peak_flops`, measured by all ranks at once (collective);
    None on a GPU (its peak is not measured here yet). Measured once per process and group of
    ranks: a second trainer in the same process (tests, sweeps) reuses it, and since every member
    of the group built the first one too, all of them skip the collectives alike."""
    if device.name != "cpu":
        return None
    from mpi4py import MPI

    group, everyone = world.comm.Get_group(), MPI.COMM_WORLD.Get_group()
    key = (str(device.dtype), tuple(group.Translate_ranks(list(range(world.size)), everyone)))
    group.Free()
    everyone.Free()
    if key not in _MEASURED:
        world.comm.Barrier()  # measure together: ranks sharing a core must see each other's load
        mine = gemm_peak_flops(device.dtype)
        _MEASURED[key] = float(world.comm.allreduce(mine))
    return _MEASURED[key]

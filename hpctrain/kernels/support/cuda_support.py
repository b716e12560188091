"""What every CUDA launcher shares: launch geometry, configured launches and the simulator switch.

- Geometry: :func:`blocks_for` (grid-stride loops, :data:`THREADS` a block, at most
  :data:`MAX_BLOCKS`, and :data:`SIM_MAX_BLOCKS` on the simulator, so the loops iterate there too),
  :func:`row_grid` for 2-D elementwise kernels, :data:`UNROLL` (memory-bound loops load that many
  elements before they store any; each element is still computed alone, in the same order).
- :func:`configured`: ``kernel[grid, block, stream]`` made once per thread, kernel, geometry and
  stream, and reused; every launch is counted (:func:`count_launches`, :func:`launches`: all
  threads', for the step metrics). :func:`configured_elementwise`: the same for a grid-stride
  elementwise kernel over n items (smaller blocks on the simulator).

Whether numba runs kernels on a GPU or in its simulator (:func:`simulated`) is fixed by
``NUMBA_ENABLE_CUDASIM`` when numba is first imported. Op files reach ``numba.cuda`` and their
kernel modules through :func:`.lazy_import.lazy_import` (imported at the first launch: a run on
the CPU never pays for it), and the ordered column sums' device functions live in
column_sums_cuda.py. Importing this module restores ``np.row_stack`` where NumPy lacks it (numba-cuda 0.30 looks it up; docs/gpu.md).
"""

from __future__ import annotations

import math
import threading

import numpy as np
from numba import config

# numba-cuda <= 0.30 registers a typing overload for ``np.row_stack`` when it
# compiles its first kernel; NumPy 2.5 removed that alias, so every compile then
# fails with AttributeError (seen on a GPU image with numba-cuda 0.30.4 and
# NumPy 2.5.2). ``row_stack`` was always ``vstack``: restore the alias only
# where it is missing. Every CUDA launcher imports this module first.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

THREADS = 256        # threads per block for 1-D (elementwise) kernels
MAX_BLOCKS = 8192    # grid-stride loops cover the rest; ~60 blocks per H200 SM
# The simulator runs every thread's Python code in turn (interpreted, tens of us each); a
# small grid keeps tests fast and makes the grid-stride loops iterate.
SIM_MAX_BLOCKS = 2
# An elementwise kernel (each element computed alone: no shared memory, barrier or atomic) gives
# the same result for any block; on the simulator its blocks are one warp, where a simulated
# thread costs ~30 us a launch whether or not it has an element (256 threads: 15 ms a launch).
SIM_ELEMENTWISE_THREADS = 32


def simulated() -> bool:
    """True when numba.cuda is the CPU simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return bool(config.ENABLE_CUDASIM)


def blocks_for(n: int, threads: int = THREADS) -> int:
    """Blocks for a grid-stride loop over ``n`` items (at least one)."""
    cap = SIM_MAX_BLOCKS if simulated() else MAX_BLOCKS
    return max(1, min(cap, math.ceil(n / threads)))


def configured_elementwise(kernel, n: int, stream=0):
    """:func:`configured` for a grid-stride elementwise kernel over ``n`` items: :func:`blocks_for`
    blocks of :data:`THREADS` threads (:data:`SIM_ELEMENTWISE_THREADS` on the simulator). Only for
    kernels whose elements are computed alone, so the block size cannot change a result."""
    threads = SIM_ELEMENTWISE_THREADS if simulated() else THREADS
    return configured(kernel, blocks_for(n, threads), threads, stream)


_configured = threading.local()   # per thread: {(kernel, grid, block, stream, shared): configured kernel}
_counters: list = []              # every thread's launch counter (a one-element list), to add them up
_counters_lock = threading.Lock()


def count_launches(n: int = 1) -> None:
    """Count ``n`` host-side launches on this thread: a kernel (:func:`configured` counts its
    own), a cuBLAS call, a graph replay. Per thread, so counting takes no lock."""
    counter = getattr(_configured, "launches", None)
    if counter is None:
        counter = _configured.launches = [0]
        with _counters_lock:
            _counters.append(counter)
    counter[0] += n


def launches() -> int:
    """Launches counted so far in this process, every thread's (a step's: the difference)."""
    with _counters_lock:
        return sum(c[0] for c in _counters)


def configured(kernel, grid, block, stream=0, shared=0):
    """``kernel[grid, block, stream, shared]``, made once per thread and launch geometry and reused,
    for one launch (counted: :func:`launches`).

    On an H100 an op-table launch cost 57 us of host time against 23 us for a kernel configured
    once (benchmarks/launch_cost.py, numba-cuda of 2026-11-27). numba-cuda 0.30 keeps its last 128
    configurations (shared by all threads; older releases keep none), and a GPT step uses the
    same few hundred launch geometries every time: this keeps every one. Per thread, because a
    configured kernel holds its call's arguments while it dispatches. numba still picks the
    compiled overload by the arguments' types on each call. The simulator's configure rewrites
    the kernel object itself, so there nothing is kept.
    """
    count_launches()
    if simulated():
        return kernel[grid, block, stream, shared]
    cache = getattr(_configured, "kernels", None)
    if cache is None:
        cache = _configured.kernels = {}
    key = (kernel, grid, block, int(stream) if stream else 0, shared)   # a stream by its handle
    launch = cache.get(key)
    if launch is None:
        launch = cache[key] = kernel[grid, block, stream, shared]
    return launch


# Memory-bound kernels load UNROLL elements per trip of their loop before they
# store any. A thread whose loop stores before its next load has one load in
# flight (the compiler may not move a load above a store that could alias it),
# and the GPU's resident threads then cannot cover DRAM latency: a one-load
# copy loop reached 0.75x of cudaMemcpy's bandwidth on an H200. Each element is
# still computed alone by the same expression, and every sum adds in the same
# order as one element per trip would: the unrolling changes when loads issue,
# not what is computed (the tests hold each kernel to its CPU twin, as before).
UNROLL = 4


def row_grid(rows: int, cols: int, unroll: int = UNROLL) -> tuple[tuple[int, int], int]:
    """((blocks over columns, blocks over rows), threads) for a 2-D elementwise kernel:
    threads across the columns (coalesced; a multiple of 32, at most THREADS), one
    block row per ``unroll`` rows (grid-stride beyond 65535 block rows)."""
    threads = min(THREADS, 32 * math.ceil(max(1, cols) / 32))
    cap = SIM_MAX_BLOCKS if simulated() else 65535
    return (math.ceil(max(1, cols) / threads), max(1, min(cap, math.ceil(rows / unroll)))), threads

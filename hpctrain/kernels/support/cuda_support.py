"""What every CUDA launcher shares: launch geometry, configured launches and the simulator switch.

Importing ``numba.cuda`` creates no CUDA context (kernels compile on first
launch), so op files import it at module level. Whether numba runs kernels on a
GPU or in its simulator is fixed by ``NUMBA_ENABLE_CUDASIM`` when numba is first
imported.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
from numba import config, cuda, float64

# numba-cuda <= 0.30 registers a typing overload for ``np.row_stack`` when it
# compiles its first kernel; NumPy 2.5 removed that alias, so every compile then
# fails with AttributeError (seen on a GPU image with numba-cuda 0.30.4 and
# NumPy 2.5.2). ``row_stack`` was always ``vstack``: restore the alias only
# where it is missing. Every CUDA launcher imports this module first.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

THREADS = 256        # threads per block for 1-D (elementwise) kernels
MAX_BLOCKS = 8192    # grid-stride loops cover the rest; ~60 blocks per H200 SM
# The simulator runs every thread as a Python thread (~0.1-0.3 ms each); a
# small grid keeps tests fast and makes the grid-stride loops iterate.
SIM_MAX_BLOCKS = 2


def simulated() -> bool:
    """True when numba.cuda is the CPU simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return bool(config.ENABLE_CUDASIM)


def blocks_for(n: int, threads: int = THREADS) -> int:
    """Blocks for a grid-stride loop over ``n`` items (at least one)."""
    cap = SIM_MAX_BLOCKS if simulated() else MAX_BLOCKS
    return max(1, min(cap, math.ceil(n / threads)))


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


@cuda.jit(device=True)
def last_block_of_column(counters, flag, leader):
    """True in every thread of the block that is the last of its column (``blockIdx.x``) of
    blocks to get here, over ``gridDim.y`` blocks; that block then owns the column's final
    sum (reading the others' partials) and the counter is already reset for the next launch.
    Call after writing the block's partials, from every thread (it has barriers); ``flag`` is
    a shared int32[1], ``leader`` 0 in one thread. The fence orders each thread's partial
    stores before its block's ticket: the last block sees every partial (the CUDA
    programming guide's threadFenceReduction pattern), and the sum it forms is in chunk
    order, not arrival order: the same bits every run."""
    cuda.threadfence()
    cuda.syncthreads()
    if leader == 0:
        ticket = cuda.atomic.add(counters, cuda.blockIdx.x, 1)
        flag[0] = 1 if ticket == cuda.gridDim.y - 1 else 0
        if flag[0] == 1:
            counters[cuda.blockIdx.x] = 0
    cuda.syncthreads()
    return flag[0] == 1


@cuda.jit(device=True)
def sum_column_partials(partial, c):
    """sum over g of partial[g, c] (float64) in g order, four loaded ahead of their adds (UNROLL)."""
    n = partial.shape[0]
    s = float64(0.0)
    g = 0
    while g + 3 < n:
        p0, p1, p2, p3 = partial[g, c], partial[g + 1, c], partial[g + 2, c], partial[g + 3, c]
        s += p0
        s += p1
        s += p2
        s += p3
        g += 4
    while g < n:
        s += partial[g, c]
        g += 1
    return s


_sim_lock = threading.Lock()


def make_simulator_thread_safe() -> None:
    """Under the simulator, let one kernel launch run at a time, process-wide, give a
    block's threads one shared array per ``cuda.shared.array`` call site, and run
    ``syncthreads`` as a barrier that wakes its threads instead of a polling loop. Idempotent.

    The simulator keeps the running kernel in one module global, so a launch
    from a second thread (the bucket thread's scale and compression kernels
    while backward launches its own) is taken for a device-function call
    inside the first kernel and runs with the wrong grid. A GPU has no such
    limit (one stream per rank orders the work), so nothing changes there.
    Called by ``CudaDevice`` when it is created, not at import.
    """
    if not simulated():
        return
    from numba.cuda.simulator import kernel as sim

    kernel = sim.FakeCUDAKernel
    if getattr(kernel, "_hpctrain_serialized", False):
        return
    launch = kernel.__call__

    def serialized(self, *args):
        if self._device:  # device functions run inside a launch (on its threads): no lock
            return launch(self, *args)
        with _sim_lock:
            return launch(self, *args)
    kernel.__call__ = serialized
    kernel._hpctrain_serialized = True
    _lock_simulator_shared_arrays()
    _block_barrier_without_polling()


_shared_lock = threading.Lock()


def _lock_simulator_shared_arrays() -> None:
    """Make the simulator's ``cuda.shared.array`` give every thread of a block the same array.

    numba-cuda's simulator (0.30) keys a block's shared arrays by the calling
    line and creates one on a miss with no lock: two of the block's threads can
    both miss, each get its own array, and each read cells only the other
    wrote (seen as a GEMM on the simulator returning other values now and then,
    more often under load). The replacement does the lookup under a lock, with
    the same keys (file and line of the call; size 0 is the dynamic array).
    """
    from numba.core import types
    from numba.np import numpy_support
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    if getattr(FakeCUDAShared, "_hpctrain_locked", False):
        return

    def array(self, shape, dtype, alignment=None):
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        if shape == 0:  # dynamic shared memory: one buffer, as many whole items as fit
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with _shared_lock:
            found = self._allocations.get(key)
            if found is None:
                found = self._allocations[key] = np.empty(shape, dtype)
        return found
    FakeCUDAShared.array = array
    FakeCUDAShared._hpctrain_locked = True


def _block_barrier_without_polling() -> None:
    """The simulator's blocks with a condition-variable barrier instead of a polling loop.

    numba-cuda's simulator (0.30) runs a block's threads while its manager
    loops over them asking each whether it is alive or waiting in
    ``syncthreads``; that loop competes for the GIL with the threads it waits
    for (measured: 40 % of a simulated GPT step in ``is_alive`` and the loop).
    Here ``syncthreads`` counts arrivals under a condition variable and the last
    live thread to arrive (or to leave the kernel) releases the others; the
    manager only joins its threads. Same semantics: a barrier over the threads
    still running, an exception in one thread aborts the others and is raised
    with its thread and block named, as the simulator does.
    """
    from numba.cuda.simulator import kernel as sim

    manager, thread = sim.BlockManager, sim.BlockThread
    if getattr(manager, "_hpctrain_barrier", False):
        return

    def run(self, grid_point, *args):
        cond = threading.Condition()
        state = {"live": 0, "arrived": 0, "generation": 0, "abort": False, "error": None}
        self._barrier = (cond, state)

        def target():
            try:
                self._f(*args)
            except BaseException as exc:  # noqa: BLE001 - raised by the manager below
                t = threading.current_thread()
                with cond:
                    if state["error"] is None and not state["abort"]:
                        msg = f"tid={list(t.threadIdx)} ctaid={list(t.blockIdx)}" + (f": {exc}" if str(exc) else "")
                        state["error"] = (type(exc), msg, exc, sys.exc_info()[2])
                    state["abort"] = True
                    cond.notify_all()
            finally:
                with cond:
                    state["live"] -= 1
                    if state["arrived"] and state["arrived"] >= state["live"]:
                        _release(state, cond)

        threads = [thread(target, self, grid_point, point, self._debug) for point in np.ndindex(*self._block_dim)]
        state["live"] = len(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if state["error"] is not None:
            kind, msg, exc, tb = state["error"]
            try:
                new = kind(msg)
            except Exception:  # noqa: BLE001 - an exception type that wants other arguments
                raise exc.with_traceback(tb) from None
            raise new.with_traceback(tb)

    def syncthreads(self):
        cond, state = self._manager._barrier
        with cond:
            if state["abort"]:
                raise RuntimeError("abort flag set on syncthreads call")
            state["arrived"] += 1
            if state["arrived"] >= state["live"]:
                _release(state, cond)
                return
            generation = state["generation"]
            while state["generation"] == generation and not state["abort"]:
                cond.wait()
            if state["abort"]:
                raise RuntimeError("abort flag set on syncthreads clear")

    manager.run = run
    thread.syncthreads = syncthreads
    manager._hpctrain_barrier = True


def _release(state, cond) -> None:
    """Every thread waiting at the barrier goes on (call with ``cond`` held)."""
    state["arrived"] = 0
    state["generation"] += 1
    cond.notify_all()

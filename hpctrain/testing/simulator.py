"""numba's CUDA simulator, made safe for what hpctrain does with it: a test tool (opt-in).

numba-cuda's simulator (0.30) runs each kernel's threads as Python threads and keeps its state in
module globals; hpctrain launches kernels from two threads at once (the communication thread's
beside the main thread's) and relies on shared arrays and barriers behaving as on a GPU.
:func:`make_thread_safe` patches the simulator's internals so it does. Call it before kernels run
on the simulator: tests/conftest.py does for every test, the benchmarks do under the simulator,
and ``python -m hpctrain.testing`` does for a whole run. Production code never calls it: a GPU
needs none of it, and :class:`~hpctrain.device.CudaDevice` patches nothing.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from ..kernels.support.cuda_support import simulated

_sim_lock = threading.Lock()


def make_thread_safe() -> None:
    """Under the simulator, let one kernel launch run at a time, process-wide, give a
    block's threads one shared array per ``cuda.shared.array`` call site, and run each block's
    threads as greenlets on the launching thread, switched at each ``syncthreads``. Idempotent;
    nothing happens on a GPU (the simulator is off).

    The simulator keeps the running kernel in one module global, so a launch
    from a second thread (the bucket thread's scale and compression kernels
    while backward launches its own) is taken for a device-function call
    inside the first kernel and runs with the wrong grid. A GPU has no such
    limit (one stream per rank orders the work).
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
    _blocks_as_greenlets()


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


def _blocks_as_greenlets() -> None:
    """A block's CUDA threads as greenlets on the launching thread, switched in turn at each
    ``syncthreads``, instead of one Python thread each (greenlet: a test dependency the set-up
    installs).

    A round switches into every live CUDA thread of the block in ``threadIdx`` order; each runs
    until it reaches the barrier or leaves the kernel, and the next round starts once all have:
    the same barrier over the threads still running. What it saves is a Python thread started
    and joined per CUDA thread (256 per block for most kernels) and an operating-system wake-up
    per thread at every barrier (and numba's polling of its threads), most of a simulated step's
    cost. The simulator finds the running
    CUDA thread as ``threading.current_thread()``: the launching thread carries its ``threadIdx``,
    ``blockIdx`` and barrier for the block's run (launches are one at a time: :func:`make_thread_safe`).
    An exception in one CUDA thread stops the block and is raised with its thread and block named,
    as the simulator does.
    """
    import types

    import greenlet

    from numba.cuda.simulator import kernel as sim
    from numba.cuda.simulator.kernelapi import Dim3

    manager = sim.BlockManager
    if getattr(manager, "_hpctrain_greenlets", False):
        return
    carried = ("threadIdx", "blockIdx", "thread_id", "_manager", "syncthreads", "syncthreads_count",
               "syncthreads_and", "syncthreads_or")

    def run(self, grid_point, *args):
        points = list(np.ndindex(*self._block_dim))
        bx, by, _ = self._block_dim
        me, hub = threading.current_thread(), greenlet.getcurrent()
        kept = {name: me.__dict__[name] for name in carried if name in me.__dict__}

        me.blockIdx, me._manager, me.syncthreads = Dim3(*grid_point), self, hub.switch
        for name in ("syncthreads_count", "syncthreads_and", "syncthreads_or"):
            setattr(me, name, types.MethodType(getattr(sim.BlockThread, name), me))
        live = [(p, greenlet.greenlet(lambda: self._f(*args))) for p in points]
        try:
            while live:
                waiting = []
                for (x, y, z), let in live:
                    me.threadIdx, me.thread_id = Dim3(x, y, z), x + bx * (y + by * z)
                    let.switch()   # until it waits at the barrier or returns
                    if not let.dead:
                        waiting.append(((x, y, z), let))
                live = waiting
        except Exception as exc:
            where = f"tid={list(me.threadIdx)} ctaid={list(me.blockIdx)}"
            try:
                named = type(exc)(f"{where}: {exc}" if str(exc) else where)
            except Exception:  # noqa: BLE001 - an exception type that wants other arguments
                raise exc from None
            raise named.with_traceback(exc.__traceback__) from None
        finally:
            for _, let in live:   # an exception left these waiting: end them here
                if not let.dead:
                    let.throw(greenlet.GreenletExit)
            for name in carried:
                me.__dict__.pop(name, None)
            me.__dict__.update(kept)

    manager.run = run
    manager._hpctrain_greenlets = True

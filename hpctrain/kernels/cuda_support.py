"""What every CUDA launcher shares: launch geometry and the simulator switch.

Importing ``numba.cuda`` creates no CUDA context (kernels compile on first
launch), so op files import it at module level. Whether numba runs kernels on a
GPU or in its simulator is fixed by ``NUMBA_ENABLE_CUDASIM`` when numba is first
imported.
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


_sim_lock = threading.Lock()


def serialize_simulator_launches() -> None:
    """Under the simulator, let one kernel launch run at a time, process-wide. Idempotent.

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

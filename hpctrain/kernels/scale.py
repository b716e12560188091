"""Scale op: buf *= factor in place (the 1/world average after a sum all-reduce).

The factor is rounded to the buffer's dtype first, so float32 buffers are
multiplied in float32 on both targets.
"""

import numpy as np
from numba import cuda

from .cuda_support import THREADS, blocks_for, configured


# ---- CPU twin (NumPy) --------------------------------------------------------------
def scale(buf, factor):
    """buf (any shape) *= factor. Returns buf."""
    buf *= buf.dtype.type(factor)
    return buf


# ---- CUDA kernel -------------------------------------------------------------------
@cuda.jit
def _scale_kernel(buf, factor):
    # four elements a grid-stride apart loaded before any is stored (cuda_support.UNROLL)
    n, i, s = buf.size, cuda.grid(1), cuda.gridsize(1)
    while i + 3 * s < n:
        a0, a1, a2, a3 = buf[i], buf[i + s], buf[i + 2 * s], buf[i + 3 * s]
        buf[i] = a0 * factor
        buf[i + s] = a1 * factor
        buf[i + 2 * s] = a2 * factor
        buf[i + 3 * s] = a3 * factor
        i += 4 * s
    while i < n:
        buf[i] *= factor
        i += s


# ---- launcher ----------------------------------------------------------------------
def scale_cuda(buf, factor, *, stream=0):
    flat = buf.reshape(buf.size)  # a view: flat device buffers are contiguous
    configured(_scale_kernel, blocks_for(buf.size), THREADS, stream)(flat, np.dtype(buf.dtype).type(factor))
    return buf

"""Scale op: buf *= factor in place (the 1/world average after a sum all-reduce).

The factor is rounded to the buffer's dtype first, so float32 buffers are
multiplied in float32 on both targets.
"""

import numpy as np
from numba import cuda

from .cuda_support import THREADS, blocks_for


# ---- CPU twin (NumPy) --------------------------------------------------------------
def scale(buf, factor):
    """buf (any shape) *= factor. Returns buf."""
    buf *= buf.dtype.type(factor)
    return buf


# ---- CUDA kernel -------------------------------------------------------------------
@cuda.jit
def _scale_kernel(buf, factor):
    i = cuda.grid(1)
    while i < buf.size:
        buf[i] *= factor
        i += cuda.gridsize(1)


# ---- launcher ----------------------------------------------------------------------
def scale_cuda(buf, factor, *, stream=0):
    flat = buf.reshape(buf.size)  # a view: flat device buffers are contiguous
    _scale_kernel[blocks_for(buf.size), THREADS, stream](flat, np.dtype(buf.dtype).type(factor))
    return buf

"""Scale op: buf *= factor in place (the 1/world average after a sum all-reduce).

The factor is rounded to the buffer's dtype first, so float32 buffers are
multiplied in float32 on both targets.
"""

import numpy as np

from .support.cuda_support import THREADS, blocks_for, configured
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.scale_cuda")  # the CUDA kernels launched here (imported at the first launch)


# ---- CPU twin (NumPy) --------------------------------------------------------------
def scale(buf, factor):
    """buf (any shape) *= factor. Returns buf."""
    buf *= buf.dtype.type(factor)
    return buf


# ---- launcher ----------------------------------------------------------------------
def scale_cuda(buf, factor, *, stream=0):
    flat = buf.reshape(buf.size)  # a view: flat device buffers are contiguous
    configured(kernels.scale_kernel, blocks_for(buf.size), THREADS, stream)(flat, np.dtype(buf.dtype).type(factor))
    return buf

"""Scale op: buf *= factor in place (the 1/world average after a sum all-reduce).

The factor is rounded to the buffer's dtype first, so float32 buffers are
multiplied in float32 on both targets.
"""

import numpy as np

from .support.cuda_support import configured_elementwise
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
    configured_elementwise(kernels.scale_kernel, buf.size, stream)(flat, np.dtype(buf.dtype).type(factor))
    return buf

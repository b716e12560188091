"""The CUDA kernels of lowp.py: one grid-stride loop per conversion, compiling lowp.py's integer
functions of the bits (the ones its CPU loops compile), so both targets give the same bits.
Launched by lowp.py.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda


@lru_cache(maxsize=None)
def conversion_kernel(convert):
    """A grid-stride kernel applying ``convert`` (one of lowp.py's conversions; passed in because
    lowp.py imports this module) to each element's bits: src[i] -> dst[i]."""
    one = cuda.jit(device=True)(convert)

    @cuda.jit
    def kernel(src, dst):
        i, s = cuda.grid(1), cuda.gridsize(1)
        while i < src.size:
            dst[i] = one(np.int64(src[i]))
            i += s
    return kernel

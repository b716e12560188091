"""The CUDA kernel of finite.py: a grid-stride pass that raises a flag at the first non-finite
value. Launched by finite.py.
"""

from __future__ import annotations

import math

from numba import cuda


@cuda.jit
def nonfinite_kernel(buf, flag):
    i = cuda.grid(1)
    while i < buf.size:
        x = buf[i]
        if not math.isfinite(x):
            flag[0] = 1  # any thread may set it: a race between equal writes is harmless
        i += cuda.gridsize(1)

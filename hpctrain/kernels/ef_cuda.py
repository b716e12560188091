"""The CUDA kernels of ef.py's error-feedback steps: one grid-stride loop each, the twins' float32
operation per element (so both give the same bits). Launched by ef.py.
"""

from __future__ import annotations

import numpy as np
from numba import cuda


@cuda.jit
def ef_correct_kernel(x, r):
    i = cuda.grid(1)
    while i < r.size:
        r[i] = np.float32(x[i]) + r[i]
        i += cuda.gridsize(1)


@cuda.jit
def lowrank_residual_kernel(m, a, size):
    i = cuda.grid(1)
    while i < m.size:
        m[i] = m[i] - a[i] / size
        i += cuda.gridsize(1)


@cuda.jit
def cast_copy_kernel(src, dst):
    i = cuda.grid(1)
    while i < dst.size:
        dst[i] = src[i]
        i += cuda.gridsize(1)


@cuda.jit
def fill_kernel(dst, value):
    i = cuda.grid(1)
    while i < dst.size:
        dst[i] = value
        i += cuda.gridsize(1)

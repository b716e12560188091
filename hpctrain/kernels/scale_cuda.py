"""The CUDA kernel of scale.py: buf *= factor, four elements a grid-stride apart loaded before any
is stored (cuda_support.UNROLL). Launched by scale.py.
"""

from __future__ import annotations

from numba import cuda


@cuda.jit
def scale_kernel(buf, factor):
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

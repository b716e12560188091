"""The CUDA kernel of lamb.py: a grid-stride loop of lamb.py's element direction, compiled here for
the GPU, so the twin and the kernel run one function. Launched by lamb.py.
"""

from __future__ import annotations

from functools import lru_cache

from numba import cuda


@lru_cache(maxsize=None)
def lamb_direction_kernel(direction):
    """The direction kernel over ``direction`` (lamb.py's ``_direction``; passed in because lamb.py
    imports this module)."""
    one = cuda.jit(device=True)(direction)

    @cuda.jit
    def kernel(p, g, m, v, out, hyper):
        beta1, one_minus_beta1, beta2, one_minus_beta2 = hyper[0], hyper[1], hyper[2], hyper[3]
        eps, inv_bc1, inv_sqrt_bc2, weight_decay = hyper[4], hyper[5], hyper[6], hyper[7]
        i = cuda.grid(1)
        while i < p.size:
            out[i] = one(p[i], g[i], m[i], v[i], beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                         inv_bc1, inv_sqrt_bc2, weight_decay)
            i += cuda.gridsize(1)
    return kernel

"""The CUDA kernel of adamw.py: a grid-stride loop of adamw.py's element update, compiled here for
the GPU, so the twin and the kernel run one function. Launched by adamw.py.
"""

from __future__ import annotations

from functools import lru_cache

from numba import cuda


@lru_cache(maxsize=None)
def adamw_update_kernel(update):
    """The update kernel over ``update`` (adamw.py's ``_update``; passed in because adamw.py imports
    this module)."""
    one = cuda.jit(device=True)(update)

    @cuda.jit
    def kernel(p, g, m, v, hyper, velocity):
        decay, beta1, one_minus_beta1, beta2 = hyper[0], hyper[1], hyper[2], hyper[3]
        one_minus_beta2, eps, step_size, inv_sqrt_bc2 = hyper[4], hyper[5], hyper[6], hyper[7]
        i = cuda.grid(1)
        while i < p.size:
            p[i], m[i], v[i] = one(p[i], g[i], m[i], v[i], decay, beta1, one_minus_beta1, beta2,
                                   one_minus_beta2, eps, step_size, inv_sqrt_bc2, velocity)
            i += cuda.gridsize(1)
    return kernel

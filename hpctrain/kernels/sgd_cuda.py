"""The CUDA kernel of sgd.py: a grid-stride loop of sgd.py's element update, compiled here for the
GPU, so the twin and the kernel run one function. Launched by sgd.py.
"""

from __future__ import annotations

from functools import lru_cache

from numba import cuda


@lru_cache(maxsize=None)
def sgd_update_kernel(update):
    """The update kernel over ``update`` (sgd.py's ``_update``; passed in because sgd.py imports this
    module)."""
    one = cuda.jit(device=True)(update)

    @cuda.jit
    def kernel(p, g, v, hyper, nesterov):
        lr, momentum, weight_decay = hyper[0], hyper[1], hyper[2]
        i = cuda.grid(1)
        while i < p.size:
            p[i], v[i] = one(p[i], g[i], v[i], lr, momentum, weight_decay, nesterov)
            i += cuda.gridsize(1)
    return kernel

"""The CUDA kernels of gather_scatter.py's sparse take and scatter (one thread per index; the
indices are distinct). Launched by gather_scatter.py.
"""

from __future__ import annotations

from numba import cuda


@cuda.jit
def sparse_take_kernel(r, idx, values):
    j = cuda.grid(1)
    while j < idx.size:
        i = idx[j]
        v = r[i]
        values[j] = v
        r[i] = v - v
        j += cuda.gridsize(1)


@cuda.jit
def sparse_scatter_kernel(out, idx, values, accumulate):
    j = cuda.grid(1)
    while j < idx.size:
        if accumulate:
            out[idx[j]] += values[j]
        else:
            out[idx[j]] = values[j]
        j += cuda.gridsize(1)

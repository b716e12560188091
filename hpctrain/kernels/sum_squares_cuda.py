"""The CUDA kernel of sum_squares.py: each block's float64 sum of squares of its grid-stride
elements, its threads' sums added in a fixed tree in shared memory. Launched by sum_squares.py.
"""

from __future__ import annotations

from numba import cuda, float64

from .support.cuda_support import THREADS


@cuda.jit
def sum_squares_kernel(buf, partials):
    # partials[block] <- the float64 sum of squares of this block's grid-stride elements
    shared = cuda.shared.array(THREADS, float64)
    tid = cuda.threadIdx.x
    i, stride = cuda.grid(1), cuda.gridsize(1)
    acc = 0.0
    while i < buf.size:
        v = float64(buf[i])
        acc += v * v
        i += stride
    shared[tid] = acc
    cuda.syncthreads()
    width = THREADS // 2
    while width > 0:
        if tid < width:
            shared[tid] += shared[tid + width]
        cuda.syncthreads()
        width //= 2
    if tid == 0:
        partials[cuda.blockIdx.x] = shared[0]

"""The CUDA kernels of sign_pack.py: per-chunk L1 scales with the error feedback fused, sign
packing and the unpack-and-sum, in the summation order sign_pack.py documents. Launched by
sign_pack.py.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda, float64


@lru_cache(maxsize=None)
def chunk_scales_ef_kernel(SUM_THREADS: int):
    """The scales kernel for blocks of ``SUM_THREADS`` threads (sign_pack.SUM_THREADS: the twin
    sums in that block's order, so the constant lives beside the twin and is passed in)."""

    @cuda.jit
    def kernel(x, r, chunk, scales):
        partial = cuda.shared.array(SUM_THREADS, float64)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        while b < scales.size:            # uniform per block: every thread takes the same turns
            lo = b * chunk
            hi = min(lo + chunk, r.size)
            s = np.float64(0.0)
            i = lo + t
            while i < hi:
                c = np.float32(x[i]) + r[i]
                r[i] = c
                s += abs(np.float64(c))
                i += SUM_THREADS
            partial[t] = s
            cuda.syncthreads()
            half = SUM_THREADS // 2
            while half > 0:
                if t < half:
                    partial[t] += partial[t + half]
                cuda.syncthreads()
                half //= 2
            if t == 0:
                scales[b] = np.float32(partial[0] / (hi - lo))
            cuda.syncthreads()            # partial[0] is read before the next chunk overwrites it
            b += cuda.gridDim.x

    return kernel


@cuda.jit
def pack_ef_kernel(c, scales, chunk, bits):
    j = cuda.grid(1)
    while j < bits.size:
        byte = 0
        for lane in range(8):
            i = 8 * j + lane
            if i < c.size:
                s = scales[i // chunk]
                v = c[i]
                if v < 0:
                    byte |= 128 >> lane
                    c[i] = v - (-s)
                else:
                    c[i] = v - s
        bits[j] = byte
        j += cuda.gridsize(1)


@cuda.jit
def unpack_sum_kernel(bits, scales, chunk, out):
    i = cuda.grid(1)
    while i < out.size:
        acc = np.float32(0.0)
        for p in range(bits.shape[0]):
            s = scales[p, i // chunk]
            if (bits[p, i >> 3] >> (7 - (i & 7))) & 1:
                acc += -s
            else:
                acc += s
        out[i] = acc
        i += cuda.gridsize(1)

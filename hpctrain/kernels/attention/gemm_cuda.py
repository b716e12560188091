"""The numba kernels of the GEMM attention (``model.attention = gemm``); what they compute, and
the GEMMs around them, are in :mod:`.gemm`.

One block per score row (grid-stride over a chunk's n T rows); threads stride over the row's
columns and reduce in shared memory by a fixed-order tree (the same bits every run). Built
(and cached) per (dtype, threads): the block size is a compile-time constant of the shared
arrays.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, float64

from ..support.cuda_support import simulated

# lse is the chunk's (n, T) view of the (B, NH, T) array: lse[b, h:h + n] along heads, lse[b:b + n, h] along rows.
@lru_cache(maxsize=None)
def row_kernels(dtype_name: str, threads: int):
    """(softmax_rows, probs, grad_rows) for one dtype and block size (a power of two)."""
    nb = {"float32": float32, "float64": float64}[dtype_name]
    ZERO, NEG_INF = np.dtype(dtype_name).type(0), np.dtype(dtype_name).type(-np.inf)

    @cuda.jit(device=True)
    def tree(red, tid, is_max):
        # red[0] <- max or sum of red[0 .. threads); every thread waits for it
        cuda.syncthreads()
        half = threads // 2
        while half > 0:
            if tid < half:
                red[tid] = max(red[tid], red[tid + half]) if is_max else red[tid] + red[tid + half]
            cuda.syncthreads()
            half //= 2
        return red[0]

    @cuda.jit
    def softmax_rows(s, scale, lse, n):
        # s (G, T, T) holds q k^T; row t becomes P: exp(scale (s - max)) / sum over u <= t, 0 above;
        # lse (n, T) <- scale max + log(sum)
        T = s.shape[1]
        tid = cuda.threadIdx.x
        red = cuda.shared.array(threads, float64)
        r = cuda.blockIdx.x
        while r < n * T:
            g, t = r // T, r % T
            m = NEG_INF
            u = tid
            while u <= t:
                m = max(m, s[g, t, u])
                u += threads
            red[tid] = m
            m = nb(tree(red, tid, True))
            cuda.syncthreads()  # red[0] is read by every thread before it is reused
            acc = 0.0
            u = tid
            while u <= t:
                e = math.exp((s[g, t, u] - m) * scale)
                s[g, t, u] = e
                acc += e
                u += threads
            red[tid] = acc
            total = tree(red, tid, False)
            inv = 1.0 / total
            u = tid
            while u < T:
                s[g, t, u] = s[g, t, u] * inv if u <= t else ZERO
                u += threads
            if tid == 0:
                lse[g, t] = m * scale + math.log(total)
            cuda.syncthreads()
            r += cuda.gridDim.x

    @cuda.jit
    def probs(s, scale, lse, n):
        # s (G, T, T) holds q k^T; it becomes P = exp(scale s - lse) for u <= t, 0 above
        T = s.shape[1]
        i = cuda.grid(1)
        while i < n * T * T:
            g, t, u = i // (T * T), i // T % T, i % T
            s[g, t, u] = math.exp(s[g, t, u] * scale - lse[g, t]) if u <= t else ZERO
            i += cuda.gridsize(1)

    @cuda.jit
    def grad_rows(p, dp, scale, n):
        # dp (G, T, T) holds dY V^T; it becomes dS = scale P (dP - rowsum(P dP)), 0 above the diagonal
        T = p.shape[1]
        tid = cuda.threadIdx.x
        red = cuda.shared.array(threads, float64)
        r = cuda.blockIdx.x
        while r < n * T:
            g, t = r // T, r % T
            acc = 0.0
            u = tid
            while u <= t:
                acc += float64(p[g, t, u]) * dp[g, t, u]
                u += threads
            red[tid] = acc
            d = tree(red, tid, False)
            u = tid
            while u < T:
                dp[g, t, u] = scale * p[g, t, u] * (dp[g, t, u] - d) if u <= t else ZERO
                u += threads
            cuda.syncthreads()
            r += cuda.gridDim.x

    return softmax_rows, probs, grad_rows


def row_threads() -> int:
    """Threads per row block: 128 on a GPU (T up to thousands of columns); 32 on the simulator,
    where each thread's code is interpreted."""
    return 32 if simulated() else 128

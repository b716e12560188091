"""The tiled GEMM kernels of linear.py's numba path: c <- (c +) op(a) @ op(b) in the operands'
dtype, one kernel per (transpose flags, dtype, tiling), each thread accumulating a TM x TN
block in registers. Launched by linear.py (gemm_cuda).
"""

from __future__ import annotations

from functools import lru_cache

from numba import cuda, float32, float64


# C (M, N) (+)= op(A) @ op(B). A block of 16 x 16 threads computes a BM x BN tile
# of C; each thread owns TM x TN outputs strided by 16, so a warp's shared
# loads are conflict-free (or broadcast) and its global stores coalesced. K
# advances in BK slabs staged through shared memory. Three tilings:
#   tiny   16 x 16, 1 output per thread, BK 16: skinny products (M or N <= 16,
#          a batch of a few rows), where a 64-wide tile would be three quarters
#          empty: each thread does a sixteenth of the small tiling's FMAs;
#   small  64 x 64, 4 x 4 per thread, BK 16: more blocks for the MLP's modest
#          shapes (B x 256 layers would leave most SMs idle with big tiles);
#   large  128 x 128, 8 x 8 per thread, BK 8: 4 FMAs per shared-memory load
#          instead of 2, for big products where the grid fills the GPU anyway.
TILES = {"tiny": (16, 16, 16, 1, 1), "small": (64, 64, 16, 4, 4),
         "large": (128, 128, 8, 8, 8)}  # BM, BN, BK, TM, TN
THREADS_X = THREADS_Y = 16
MAX_GRID_Y = 65535           # CUDA's limit on gridDim.y (rows of tiles)


@lru_cache(maxsize=None)
def gemm_kernel(trans_a: bool, trans_b: bool, dtype_name: str, tile: str = "small"):
    """The kernel for one (transpose, dtype, tiling); all of them are compile-time constants."""
    nb = {"float32": float32, "float64": float64}[dtype_name]
    BM, BN, BK, TM, TN = TILES[tile]
    TX, TY = THREADS_X, THREADS_Y
    NT = TX * TY
    LOADS_A, LOADS_B = BM * BK // NT, BN * BK // NT
    # Row stride BM + 32/BK: a warp's k-fast stores (BK consecutive k, then the
    # next m) land on 32 distinct banks; m-fast stores and the compute loop's
    # reads stay conflict-free (consecutive m) or broadcast (same address).
    A_COLS, B_COLS = BM + 32 // BK, BN + 32 // BK

    @cuda.jit
    def gemm(a, b, c, accumulate):
        M, N = c.shape
        K = a.shape[0] if trans_a else a.shape[1]
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        tid = ty * TX + tx
        m0, n0 = cuda.blockIdx.y * BM, cuda.blockIdx.x * BN
        As = cuda.shared.array((BK, A_COLS), nb)
        Bs = cuda.shared.array((BK, B_COLS), nb)
        acc = cuda.local.array((TM, TN), nb)
        ra = cuda.local.array(TM, nb)
        rb = cuda.local.array(TN, nb)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0
        for k0 in range(0, K, BK):
            # Stage the A and B slabs. Consecutive threads walk the operand's
            # contiguous axis, so global loads coalesce whether or not it is
            # transposed; out-of-range elements are zero (partial tiles).
            for l in range(LOADS_A):
                e = tid + l * NT
                if trans_a:          # a is (K, M)
                    mm, kk = e % BM, e // BM
                    if m0 + mm < M and k0 + kk < K:
                        As[kk, mm] = a[k0 + kk, m0 + mm]
                    else:
                        As[kk, mm] = 0
                else:                # a is (M, K)
                    kk, mm = e % BK, e // BK
                    if m0 + mm < M and k0 + kk < K:
                        As[kk, mm] = a[m0 + mm, k0 + kk]
                    else:
                        As[kk, mm] = 0
            for l in range(LOADS_B):
                e = tid + l * NT
                if trans_b:          # b is (N, K)
                    kk, nn = e % BK, e // BK
                    if n0 + nn < N and k0 + kk < K:
                        Bs[kk, nn] = b[n0 + nn, k0 + kk]
                    else:
                        Bs[kk, nn] = 0
                else:                # b is (K, N)
                    nn, kk = e % BN, e // BN
                    if n0 + nn < N and k0 + kk < K:
                        Bs[kk, nn] = b[k0 + kk, n0 + nn]
                    else:
                        Bs[kk, nn] = 0
            cuda.syncthreads()
            for kk in range(BK):
                for i in range(TM):
                    ra[i] = As[kk, ty + i * TY]
                for j in range(TN):
                    rb[j] = Bs[kk, tx + j * TX]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += ra[i] * rb[j]
            cuda.syncthreads()  # the slab is consumed before the next one overwrites it
        for i in range(TM):
            m = m0 + ty + i * TY
            if m < M:
                for j in range(TN):
                    n = n0 + tx + j * TX
                    if n < N:
                        if accumulate:
                            c[m, n] += acc[i, j]
                        else:
                            c[m, n] = acc[i, j]

    return gemm

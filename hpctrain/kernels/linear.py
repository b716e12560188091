"""Linear op (the GEMM half; bias and activation are :mod:`.bias_act`).

x (B, I), w (I, O), z (B, O):  forward z = x @ w;  backward dw = x^T @ dz and
dx = dz @ w^T. The weight is stored (I, O) so the forward GEMM reads it
row-major. The CPU twin passes transposed views to BLAS; the CUDA kernel reads
the transposed operand through its tile loader - no transpose is materialised.

The tied LM head (``tied_head_*``) is the same pair with the weight stored the
other way round, (O, I) = the embedding table wte (V, C): logits = x @ wte^T,
dwte (+)= dlogits^T @ x, dx = dlogits @ wte. It has its own entry points
because a numba device array's ``.T`` is not a view (numba copies it with a
transpose kernel), so ``linear_*(x, wte.T, ...)`` would write a gradient
nobody reads; the transpose flags of the GEMM do it without a copy.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda, float32, float64

from .cuda_support import configured, simulated


# ---- CPU twin (NumPy/BLAS) ---------------------------------------------------------
def linear_forward(x, w, z):
    """z (B, O) <- x (B, I) @ w (I, O). Returns z."""
    np.matmul(x, w, out=z)
    return z


def linear_backward(dz, x, w, dx, dw, accumulate=False):
    """dw (I, O) <- (dw +) x^T @ dz; dx (B, I) <- dz @ w^T unless dx is None. Returns dx.

    dw is a view into the flat gradient buffer; dx is an activation gradient
    and is never accumulated (the first layer passes None: nobody needs it).
    """
    if accumulate:
        dw += x.T @ dz
    else:
        np.matmul(x.T, dz, out=dw)
    if dx is not None:
        np.matmul(dz, w.T, out=dx)
    return dx


def tied_head_forward(x, wte, logits):
    """logits (N, V) <- x (N, C) @ wte (V, C)^T. Returns logits."""
    np.matmul(x, wte.T, out=logits)
    return logits


def tied_head_backward(dlogits, x, wte, dx, dwte, accumulate=False):
    """dwte (V, C) <- (dwte +) dlogits^T @ x; dx (N, C) <- dlogits @ wte. Returns dx."""
    if accumulate:
        dwte += dlogits.T @ x
    else:
        np.matmul(dlogits.T, x, out=dwte)
    np.matmul(dlogits, wte, out=dx)
    return dx


# ---- CUDA kernels ------------------------------------------------------------------
# C (M, N) (+)= op(A) @ op(B). A block of 16 x 16 threads computes a BM x BN tile
# of C; each thread owns TM x TN outputs strided by 16, so a warp's shared
# loads are conflict-free (or broadcast) and its global stores coalesced. K
# advances in BK slabs staged through shared memory. Two tilings:
#   small  64 x 64, 4 x 4 per thread, BK 16: more blocks for the MLP's modest
#          shapes (B x 256 layers would leave most SMs idle with big tiles);
#   large  128 x 128, 8 x 8 per thread, BK 8: 4 FMAs per shared-memory load
#          instead of 2, for big products where the grid fills the GPU anyway.
TILES = {"small": (64, 64, 16, 4, 4), "large": (128, 128, 8, 8, 8)}  # BM, BN, BK, TM, TN
THREADS_X = THREADS_Y = 16
MAX_GRID_Y = 65535           # CUDA's limit on gridDim.y (rows of tiles)


@lru_cache(maxsize=None)
def _gemm_kernel(trans_a: bool, trans_b: bool, dtype_name: str, tile: str = "small"):
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


# ---- launchers ---------------------------------------------------------------------
def choose_tile(M: int, N: int, sms: int | None = None) -> str:
    """'large' when 128 x 128 tiles still give each of the GPU's ``sms`` SMs two blocks, else 'small'."""
    bm, bn = TILES["large"][:2]
    return "large" if -(-M // bm) * -(-N // bn) >= 2 * (sms or _sm_count()) else "small"


@lru_cache(maxsize=None)
def _sm_count() -> int:
    """Multiprocessors of the current GPU (132 on an H200; also the simulator's stand-in)."""
    if simulated():
        return 132
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def gemm_cuda(a, b, c, trans_a=False, trans_b=False, accumulate=False, *, stream=0, tile=None):
    """c (M, N) <- (c +) op(a) @ op(b), op = transpose when the flag is set. Returns c.

    ``tile`` forces a tiling ("small" or "large"); by default :func:`choose_tile` picks.
    """
    M, N = c.shape
    K = a.shape[0] if trans_a else a.shape[1]
    if (a.shape[1] if trans_a else a.shape[0]) != M or (b.shape[1] if trans_b else b.shape[0]) != K \
            or (b.shape[0] if trans_b else b.shape[1]) != N:
        raise ValueError(f"gemm shapes: a {a.shape} (T={trans_a}), b {b.shape} (T={trans_b}), c {c.shape}")
    if not (a.dtype == b.dtype == c.dtype):
        raise ValueError(f"gemm dtypes differ: {a.dtype}, {b.dtype}, {c.dtype}")
    tile = tile or choose_tile(M, N)
    bm, bn = TILES[tile][:2]
    if -(-M // bm) > MAX_GRID_Y:
        raise ValueError(f"gemm with M={M} rows needs more than {MAX_GRID_Y} tile rows; split the batch")
    kernel = _gemm_kernel(bool(trans_a), bool(trans_b), c.dtype.name, tile)
    configured(kernel, (-(-N // bn), -(-M // bm)), (THREADS_X, THREADS_Y), stream)(a, b, c, bool(accumulate))
    return c


def linear_forward_cuda(x, w, z, *, stream=0):
    """z <- x @ w on the GPU."""
    return gemm_cuda(x, w, z, stream=stream)


def linear_backward_cuda(dz, x, w, dx, dw, accumulate=False, *, stream=0):
    """dw <- (dw +) x^T dz (x read transposed); dx <- dz w^T (w read transposed)."""
    gemm_cuda(x, dz, dw, trans_a=True, accumulate=accumulate, stream=stream)
    if dx is not None:
        gemm_cuda(dz, w, dx, trans_b=True, stream=stream)
    return dx


def tied_head_forward_cuda(x, wte, logits, *, stream=0):
    """logits <- x @ wte^T on the GPU (wte read transposed)."""
    return gemm_cuda(x, wte, logits, trans_b=True, stream=stream)


def tied_head_backward_cuda(dlogits, x, wte, dx, dwte, accumulate=False, *, stream=0):
    """dwte <- (dwte +) dlogits^T x (dlogits read transposed); dx <- dlogits wte."""
    gemm_cuda(dlogits, x, dwte, trans_a=True, accumulate=accumulate, stream=stream)
    return gemm_cuda(dlogits, wte, dx, stream=stream)

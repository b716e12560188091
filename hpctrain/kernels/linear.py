"""Linear op (the GEMM half; bias and activation are :mod:`.bias_act`).

x (B, I), w (I, O), z (B, O):  forward z = x @ w;  backward dw = x^T @ dz and
dx = dz @ w^T. The weight is stored (I, O) so the forward GEMM reads it
row-major. The CPU twin passes transposed views to BLAS; the CUDA kernel reads
the transposed operand through its tile loader - no transpose is materialised.
On a GPU the GEMMs run as numba's tiled kernels (``*_cuda``, linear_cuda.py) or, under
``train.gemm = cublas``, through cuBLAS (``*_cuda_cublas``, :mod:`.support.cublas`).

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

from .support.cuda_support import configured, simulated
from .support.lazy_import import lazy_import

cuda = lazy_import("numba.cuda")  # imported at the first launch
kernels = lazy_import(f"{__package__}.linear_cuda")  # the CUDA kernels launched here (imported at the first launch)


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


# ---- launchers ---------------------------------------------------------------------
def choose_tile(M: int, N: int, sms: int | None = None) -> str:
    """'tiny' when M or N is at most 16 (a 64-wide tile would be three quarters empty) and its rows
    of tiles fit the grid; 'large' when 128 x 128 tiles still give each of the GPU's ``sms`` SMs two
    blocks; else 'small'."""
    tiny = kernels.TILES["tiny"][0]
    if min(M, N) <= tiny and -(-M // tiny) <= kernels.MAX_GRID_Y:
        return "tiny"
    bm, bn = kernels.TILES["large"][:2]
    return "large" if -(-M // bm) * -(-N // bn) >= 2 * (sms or _sm_count()) else "small"


@lru_cache(maxsize=None)
def _sm_count() -> int:
    """Multiprocessors of the current GPU (132 on an H200; also the simulator's stand-in)."""
    if simulated():
        return 132
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def gemm_cuda(a, b, c, trans_a=False, trans_b=False, accumulate=False, *, stream=0, tile=None):
    """c (M, N) <- (c +) op(a) @ op(b), op = transpose when the flag is set. Returns c.

    ``tile`` forces a tiling ("tiny", "small" or "large"); by default :func:`choose_tile` picks.
    """
    M, N = c.shape
    K = a.shape[0] if trans_a else a.shape[1]
    if (a.shape[1] if trans_a else a.shape[0]) != M or (b.shape[1] if trans_b else b.shape[0]) != K \
            or (b.shape[0] if trans_b else b.shape[1]) != N:
        raise ValueError(f"gemm shapes: a {a.shape} (T={trans_a}), b {b.shape} (T={trans_b}), c {c.shape}")
    if not (a.dtype == b.dtype == c.dtype):
        raise ValueError(f"gemm dtypes differ: {a.dtype}, {b.dtype}, {c.dtype}")
    tile = tile or choose_tile(M, N)
    bm, bn = kernels.TILES[tile][:2]
    if -(-M // bm) > kernels.MAX_GRID_Y:
        raise ValueError(f"gemm with M={M} rows needs more than {kernels.MAX_GRID_Y} tile rows; split the batch")
    kernel = kernels.gemm_kernel(bool(trans_a), bool(trans_b), c.dtype.name, tile)
    launch = configured(kernel, (-(-N // bn), -(-M // bm)), (kernels.THREADS_X, kernels.THREADS_Y), stream)
    launch(a, b, c, bool(accumulate))
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


# ---- cuBLAS launchers (train.gemm = cublas) ----------------------------------------
# ``cublas`` is a :class:`.support.cublas.CublasGemm` on the device's stream and GPU.
def linear_forward_cuda_cublas(x, w, z, *, cublas):
    """:func:`linear_forward` by cuBLAS: z <- x @ w."""
    return cublas.gemm(x, w, z)


def linear_backward_cuda_cublas(dz, x, w, dx, dw, accumulate=False, *, cublas):
    """:func:`linear_backward` by cuBLAS: dw <- (dw +) x^T dz; dx <- dz w^T unless dx is None. Returns dx."""
    cublas.gemm(x, dz, dw, trans_a=True, accumulate=accumulate)
    if dx is not None:
        cublas.gemm(dz, w, dx, trans_b=True)
    return dx


def tied_head_forward_cuda_cublas(x, wte, logits, *, cublas):
    """:func:`tied_head_forward` by cuBLAS: logits <- x @ wte^T."""
    return cublas.gemm(x, wte, logits, trans_b=True)


def tied_head_backward_cuda_cublas(dlogits, x, wte, dx, dwte, accumulate=False, *, cublas):
    """:func:`tied_head_backward` by cuBLAS: dwte <- (dwte +) dlogits^T x; dx <- dlogits wte. Returns dx."""
    cublas.gemm(dlogits, x, dwte, trans_a=True, accumulate=accumulate)
    return cublas.gemm(dlogits, wte, dx)

"""The CUDA kernels of softmax_xent.py: one block per row (its threads stride over the classes)
for the loss, the count and (fused) the gradient, the float64 row totals summed in row order,
and the backward. Launched by softmax_xent.py.
"""

from __future__ import annotations

import math

from numba import cuda, float32, float64, int64

from .support.cuda_support import THREADS


ROW_THREADS = 128  # one block per row; threads stride over the classes
_ROWS = {}


def rows_kernel(dtype: str, fused: bool):
    """One block per row (grid-stride over rows) for ``dtype`` (float32 or float64): the row's max
    with its first index, the sum of exps in float64, each row's loss and correct flag; then
    ``fused=False``: ``out`` <- the probabilities (``scale`` unused); ``fused=True``: ``out`` <-
    ``scale * (softmax - onehot)``, each value by the roundings of the stored probability and
    backward's product, so the same bits; ``out`` may then be ``logits``."""
    key = (dtype, fused)
    if key in _ROWS:
        return _ROWS[key]
    cast = float32 if dtype == "float32" else float64

    @cuda.jit
    def kernel(logits, labels, scale, out, row_loss, row_correct):
        B, C = logits.shape
        t = cuda.threadIdx.x
        vmax = cuda.shared.array(ROW_THREADS, float64)
        imax = cuda.shared.array(ROW_THREADS, int64)
        vsum = cuda.shared.array(ROW_THREADS, float64)
        r = cuda.blockIdx.x
        while r < B:
            # row max and its first index (ties -> lowest class, like the twin)
            best_v = -math.inf
            best_i = C
            c = t
            while c < C:
                v = logits[r, c]
                if v > best_v:
                    best_v, best_i = v, c
                c += ROW_THREADS
            vmax[t], imax[t] = best_v, best_i
            cuda.syncthreads()
            half = ROW_THREADS // 2
            while half > 0:
                if t < half:
                    v, i = vmax[t + half], imax[t + half]
                    if v > vmax[t] or (v == vmax[t] and i < imax[t]):
                        vmax[t], imax[t] = v, i
                cuda.syncthreads()
                half //= 2
            # no element beat -inf (a row of NaN or -inf, i.e. diverged training):
            # take class 0, as the twin does, instead of reading past the row
            best = imax[0] if imax[0] < C else 0
            m = logits[r, best]  # exact max in the input dtype
            # exp(x - max) cannot overflow; the sum accumulates in float64
            s = 0.0
            c = t
            while c < C:
                e = math.exp(logits[r, c] - m)
                if not fused:
                    out[r, c] = e
                s += e
                c += ROW_THREADS
            vsum[t] = s
            cuda.syncthreads()
            half = ROW_THREADS // 2
            while half > 0:
                if t < half:
                    vsum[t] += vsum[t + half]
                cuda.syncthreads()
                half //= 2
            total = vsum[0]
            inv = 1.0 / total
            y = labels[r]
            if t == 0:
                row_loss[r] = math.log(total) + m - logits[r, y]
                row_correct[r] = 1 if best == y else 0
            cuda.syncthreads()  # the label's logit is read before any thread overwrites the row
            c = t
            while c < C:
                if fused:
                    p = cast(cast(math.exp(logits[r, c] - m)) * inv)   # forward's stored probability
                    d = p * scale                                       # backward's product
                    if c == y:
                        d -= scale
                    out[r, c] = d
                else:
                    out[r, c] *= inv
                c += ROW_THREADS
            cuda.syncthreads()  # shared arrays are reused by the next row
            r += cuda.gridDim.x
    _ROWS[key] = kernel
    return kernel


@cuda.jit
def sum_rows_kernel(row_loss, row_correct, out, accumulate):
    # one block: each thread sums a strided share, then a fixed-order tree; out <- (or +=) the sums
    t = cuda.threadIdx.x
    sl = cuda.shared.array(THREADS, float64)
    sc = cuda.shared.array(THREADS, float64)
    a = 0.0
    k = 0.0
    i = t
    while i < row_loss.shape[0]:
        a += row_loss[i]
        k += row_correct[i]
        i += THREADS
    sl[t], sc[t] = a, k
    cuda.syncthreads()
    half = THREADS // 2
    while half > 0:
        if t < half:
            sl[t] += sl[t + half]
            sc[t] += sc[t + half]
        cuda.syncthreads()
        half //= 2
    if t == 0:
        if accumulate:
            out[0] += sl[0]
            out[1] += sc[0]
        else:
            out[0], out[1] = sl[0], sc[0]


@cuda.jit
def softmax_xent_backward_kernel(probs, labels, scale, dlogits):
    B, C = probs.shape
    i = cuda.grid(1)
    while i < B * C:
        r, c = i // C, i % C
        d = probs[r, c] * scale          # same rounding steps as the twin
        if c == labels[r]:
            d -= scale
        dlogits[r, c] = d
        i += cuda.gridsize(1)

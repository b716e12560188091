"""Layer normalisation over the channels of each row (GPT-2's ln_1, ln_2, ln_f).

x (N, C) with N = B * T rows, weight and bias (C,), out (N, C), mean and rstd (N,) saved for
backward, all in one float dtype:

forward:  mean = sum(x) / C;  var = sum((x - mean)^2) / C (biased, as PyTorch);
          rstd = 1 / sqrt(var + eps);  xhat = (x - mean) * rstd;  out = xhat * weight + bias
backward: with g = dout * weight, per row
          dx = (g - mean(g) - xhat * mean(g * xhat)) * rstd   (``add_dx``: added to dx);
          dweight = sum over rows of dout * xhat;  dbias = sum over rows of dout.

:func:`residual_layernorm_forward` forms x = a + b first (a pre-LN block's residual add), in the same
pass, with the bits of the add then the LayerNorm. Forward normalises in float64 and rounds once on
store; backward forms xhat and g in x's dtype, then sums and forms dx in float64; the parameter
gradients are float64 partial sums per chunk of cpu_threads.CHUNK_ROWS rows, added in chunk order
(the same bits at any thread count). The CUDA kernels (:mod:`.layernorm_cuda`) follow the same rules
(memory-bound, float64 costs them no time) in another fixed order: float32 results agree with the
twin's to an ulp.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .support import cpu_threads
from .support.cuda_support import blocks_for, configured
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.layernorm_cuda")  # the CUDA kernels launched here (imported at the first launch)


# ---- CPU twin (numba) --------------------------------------------------------------
# Row sums run four independent chains (lane c % 4, combined as (0 + 1) + (2 + 3)):
# one chain waits on each add's latency, four keep the adder busy (forward 2x,
# backward 1.3x faster at N = 2048, C = 128, float32); the order is fixed, so
# the bits are the same on every run.
# (Kept in this file, not shared with attention's: numba's disk cache only
# notices edits to the file of the function it cached.)
@njit(cache=True, nogil=True)
def _dot4(a, b):
    n = a.shape[0]
    s0 = s1 = s2 = s3 = 0.0
    c = 0
    while c + 4 <= n:
        s0 += a[c] * b[c]
        s1 += a[c + 1] * b[c + 1]
        s2 += a[c + 2] * b[c + 2]
        s3 += a[c + 3] * b[c + 3]
        c += 4
    while c < n:
        s0 += a[c] * b[c]
        c += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True)
def _layernorm_forward(a, b, x, weight, bias, out, mean, rstd, eps, add):
    # add: x <- a + b first, each row as it is normalised (one pass over a and b instead of a
    # separate add and a second read of x); else x is a (b unused)
    N, C = x.shape
    d = np.empty(C)  # the row in float64
    ones = np.ones(C)
    for i in range(N):
        # Mean, then the centred sum of squares: two sweeps of a row that sits
        # in L1, so memory is read once, and no E[x^2] - E[x]^2 cancellation
        # when |mean| >> std (a one-sweep sum of squares loses it all there).
        if add:
            for c in range(C):
                x[i, c] = a[i, c] + b[i, c]
        for c in range(C):
            d[c] = x[i, c]
        m = _dot4(d, ones) / C
        for c in range(C):
            d[c] -= m
        r = 1.0 / math.sqrt(_dot4(d, d) / C + eps)
        mean[i] = m
        rstd[i] = r
        for c in range(C):
            out[i, c] = d[c] * r * weight[c] + bias[c]


@njit(cache=True, nogil=True)
def _layernorm_backward(dout, x, weight, mean, rstd, dx, dw, db, add_dx):
    # dw, db: float64 sums over these rows, in row order (zero on entry)
    N, C = x.shape
    g = np.empty(C)   # dout * weight, then the row's input gradient
    xhat = np.empty(C)
    ones = np.ones(C)
    for i in range(N):
        m = float(mean[i])
        r = float(rstd[i])
        for c in range(C):
            d = float(dout[i, c])
            xhat[c] = (x[i, c] - m) * r
            g[c] = d * weight[c]
            dw[c] += d * xhat[c]
            db[c] += d
        # the two row means the input gradient needs
        g_mean = _dot4(g, ones) / C
        gx_mean = _dot4(g, xhat) / C
        for c in range(C):  # dout[i] was read in full above: dx may be dout
            v = (g[c] - g_mean - xhat[c] * gx_mean) * r
            if add_dx:
                dx[i, c] += v
            else:
                dx[i, c] = v


@njit(cache=True, nogil=True)
def _layernorm_backward_chunks(dout, x, weight, mean, rstd, dx, dw, db, add_dx, c0, c1, chunk_rows):
    """:func:`_layernorm_backward` of chunks c0..c1 of ``chunk_rows`` rows, chunk c's sums in dw[c], db[c]."""
    N = x.shape[0]
    for c in range(c0, c1):
        lo, hi = c * chunk_rows, min(N, (c + 1) * chunk_rows)
        _layernorm_backward(dout[lo:hi], x[lo:hi], weight, mean[lo:hi], rstd[lo:hi], dx[lo:hi], dw[c], db[c], add_dx)


# ns per element on one core (2-core EPYC, float32, C = 128): whether a split pays (cpu_threads)
_NS_FORWARD, _NS_BACKWARD = 1.2, 1.4


def layernorm_forward(x, weight, bias, out, mean, rstd, eps=1e-5):
    """out (N, C) <- layernorm(x) * weight + bias; mean, rstd (N,) <- row statistics. Returns out.

    x, weight (C,), bias (C,), out, mean, rstd share one float dtype. Rows split over the CPU threads.
    """
    cpu_threads.for_rows(lambda lo, hi: _layernorm_forward(x[lo:hi], x[lo:hi], x[lo:hi], weight, bias, out[lo:hi],
                                                           mean[lo:hi], rstd[lo:hi], float(eps), False),
                         x.shape[0], x.size, ns_per_element=_NS_FORWARD)
    return out


def check_residual_operands(a, b, x) -> None:
    """ValueError unless a and b have x's shape and dtype (the fused add reads them row by row)."""
    for name, arr in (("a", a), ("b", b)):
        if tuple(arr.shape) != tuple(x.shape) or arr.dtype != x.dtype:
            raise ValueError(f"residual_layernorm_forward: {name} is {arr.dtype} {tuple(arr.shape)}, x is "
                             f"{x.dtype} {tuple(x.shape)}")


def residual_layernorm_forward(a, b, x, weight, bias, out, mean, rstd, eps=1e-5):
    """x (N, C) <- a + b (a pre-LN block's residual add), then :func:`layernorm_forward` of x.
    Returns out. The same bits as ``residual_forward(a, b, x)`` then ``layernorm_forward(x, ...)``,
    in one pass over a and b (each row added, stored and normalised while it is in cache; on the
    GPU one kernel does the same)."""
    check_residual_operands(a, b, x)
    cpu_threads.for_rows(lambda lo, hi: _layernorm_forward(a[lo:hi], b[lo:hi], x[lo:hi], weight, bias, out[lo:hi],
                                                           mean[lo:hi], rstd[lo:hi], float(eps), True),
                         x.shape[0], x.size, ns_per_element=_NS_FORWARD)
    return out


def layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias, accumulate=False, add_dx=False):
    """dx (N, C) <- (dx +) dL/dx; dweight, dbias (C,) <- (their +) dL/dweight, dL/dbias. Returns dx.

    mean and rstd are the forward's. ``add_dx`` adds the input gradient to dx
    (the residual stream's gradient already there: pre-LN blocks); ``accumulate``
    adds the parameter gradients (gradient accumulation). dx may be dout. Rows split over the CPU
    threads, the parameter gradients summed per chunk of rows (module doc).
    """
    N, C = x.shape
    chunks = cpu_threads.chunks_of(N)
    dw, db = np.zeros((chunks, C)), np.zeros((chunks, C))
    cpu_threads.for_chunks(lambda c0, c1: _layernorm_backward_chunks(dout, x, weight, mean, rstd, dx, dw, db, bool(add_dx),
                                                                     c0, c1, cpu_threads.CHUNK_ROWS),
                           N, x.size, ns_per_element=_NS_BACKWARD)
    for total, grad in ((cpu_threads.add_partials(dw), dweight), (cpu_threads.add_partials(db), dbias)):
        grad[...] = grad + total if accumulate else total
    return dx


# ---- launchers ---------------------------------------------------------------------
def _rows_grid(N):
    """(grid, block) of the row kernels: a warp of kernels.LANES per row, kernels.ROWS rows a block."""
    return blocks_for(N, kernels.ROWS), (kernels.LANES, kernels.ROWS)


def layernorm_forward_cuda(x, weight, bias, out, mean, rstd, eps=1e-5, *, stream=0):
    """As :func:`layernorm_forward`, on ``stream``. Returns out."""
    N, _ = x.shape
    configured(kernels.layernorm_forward_kernel, *_rows_grid(N), stream)(
        x, x, x, weight, bias, out, mean, rstd, np.float64(eps))
    return out


def residual_layernorm_forward_cuda(a, b, x, weight, bias, out, mean, rstd, eps=1e-5, *, stream=0):
    """As :func:`residual_layernorm_forward`: x <- a + b and its layernorm, one kernel. Returns out."""
    N, _ = x.shape
    check_residual_operands(a, b, x)
    configured(kernels.residual_layernorm_forward_kernel, *_rows_grid(N), stream)(
        a, b, x, weight, bias, out, mean, rstd, np.float64(eps))
    return out


def layernorm_backward_cuda(dout, x, weight, mean, rstd, dx, dweight, dbias, accumulate=False, add_dx=False, *,
                            stream=0, scratch):
    """As :func:`layernorm_backward`, on ``stream``; dx may be dout. Returns dx.

    ``scratch(key, shape, dtype)`` lends the two float64 (ceil(N / GRAD_ROWS), C)
    partial sums of dweight and dbias (``layernorm_cuda.GRAD_ROWS``, read at each call).
    """
    N, C = x.shape
    chunks = max(1, -(-N // kernels.GRAD_ROWS))
    if chunks > 65535:  # gridDim.y limit
        raise ValueError(f"layernorm_backward with N={N} rows exceeds {65535 * kernels.GRAD_ROWS}; "
                         f"split the batch")
    pw = scratch("ln_dweight_partial", (chunks, C), np.float64)
    pb = scratch("ln_dbias_partial", (chunks, C), np.float64)
    counters = scratch("ln_tickets", (-(-C // kernels.GRAD_COLS),), np.int32, zero=True)
    # the parameter gradients first: they read all of dout, which the dx kernel may overwrite
    grads_block = (kernels.GRAD_COLS, kernels.GRAD_LANES)
    configured(kernels.layernorm_param_grads_kernel, (len(counters), chunks), grads_block, stream)(
        dout, x, mean, rstd, pw, pb, counters, dweight, dbias, bool(accumulate))
    configured(kernels.layernorm_dx_kernel, *_rows_grid(N), stream)(dout, x, weight, mean, rstd, dx, bool(add_dx))
    return dx

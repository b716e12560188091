"""Layer normalisation over the channels of each row (GPT-2's ln_1, ln_2, ln_f).

x (N, C) with N = B * T rows, weight and bias (C,), out (N, C), mean and rstd
(N,) saved for backward:

forward:  mean = sum(x) / C;  var = sum((x - mean)^2) / C (biased, as PyTorch);
          rstd = 1 / sqrt(var + eps);  xhat = (x - mean) * rstd;
          out = xhat * weight + bias
backward: with g = dout * weight, per row
          dx = (g - mean(g) - xhat * mean(g * xhat)) * rstd;
          dweight = sum over rows of dout * xhat;  dbias = sum over rows of dout.

Statistics and the parameter-gradient sums accumulate in float64 (rows in
order, so the sums are deterministic); mean and rstd are stored in x's dtype.
Forward normalises in float64 and rounds once on store; backward forms xhat
and g = dout * weight in x's dtype (numba types ``float(float32)`` as
float32), then sums and forms dx in float64. The CUDA kernels
(layernorm_cuda.py) do the same (memory-bound, float64 costs them no time):
float32 results agree to an ulp.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


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
def _layernorm_forward(x, weight, bias, out, mean, rstd, eps):
    N, C = x.shape
    d = np.empty(C)  # the row in float64
    ones = np.ones(C)
    for i in range(N):
        # Mean, then the centred sum of squares: two sweeps of a row that sits
        # in L1, so memory is read once, and no E[x^2] - E[x]^2 cancellation
        # when |mean| >> std (a one-sweep sum of squares loses it all there).
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
def _layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias, accumulate, add_dx):
    N, C = x.shape
    dw = np.zeros(C)  # float64 sums over the rows, in row order
    db = np.zeros(C)
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
    for c in range(C):
        dweight[c] = dweight[c] + dw[c] if accumulate else dw[c]
        dbias[c] = dbias[c] + db[c] if accumulate else db[c]


def layernorm_forward(x, weight, bias, out, mean, rstd, eps=1e-5):
    """out (N, C) <- layernorm(x) * weight + bias; mean, rstd (N,) <- row statistics. Returns out.

    x, weight (C,), bias (C,), out, mean, rstd share one float dtype.
    """
    _layernorm_forward(x, weight, bias, out, mean, rstd, float(eps))
    return out


def residual_layernorm_forward(a, b, x, weight, bias, out, mean, rstd, eps=1e-5):
    """x (N, C) <- a + b (a pre-LN block's residual add), then :func:`layernorm_forward` of x.
    Returns out. The same bits as ``residual_forward(a, b, x)`` then ``layernorm_forward(x, ...)``:
    on the GPU one kernel does both (the sum written and normalised in one pass over a and b)."""
    np.add(a, b, out=x)
    return layernorm_forward(x, weight, bias, out, mean, rstd, eps)


def layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias, accumulate=False, add_dx=False):
    """dx (N, C) <- (dx +) dL/dx; dweight, dbias (C,) <- (their +) dL/dweight, dL/dbias. Returns dx.

    mean and rstd are the forward's. ``add_dx`` adds the input gradient to dx
    (the residual stream's gradient already there: pre-LN blocks); ``accumulate``
    adds the parameter gradients (gradient accumulation). dx may be dout.
    """
    _layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias, bool(accumulate), bool(add_dx))
    return dx

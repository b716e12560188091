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
float32), then sums and forms dx in float64. The CUDA kernels do the same
(memory-bound, float64 costs them no time): float32 results agree to an ulp.

CUDA: 32 lanes (a warp) per row, 8 rows per block; lane 0 adds the lanes'
shares left to right - two barriers per sum, not a tree's six (the simulator
pays ~40 ms a barrier). The order is fixed: the same bits on every run, though
not the twin's. dweight and dbias: float64 partial column sums per chunk of up
to 128 rows, then one ordered sum per column (no atomics).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64, njit

from .cuda_support import THREADS, blocks_for


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


def layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias, accumulate=False, add_dx=False):
    """dx (N, C) <- (dx +) dL/dx; dweight, dbias (C,) <- (their +) dL/dweight, dL/dbias. Returns dx.

    mean and rstd are the forward's. ``add_dx`` adds the input gradient to dx
    (the residual stream's gradient already there: pre-LN blocks); ``accumulate``
    adds the parameter gradients (gradient accumulation). dx may be dout.
    """
    _layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias, bool(accumulate), bool(add_dx))
    return dx


# ---- CUDA kernels ------------------------------------------------------------------
LANES = 32        # threads over one row's channels: a warp, coalesced loads
ROWS = 8          # rows per block (one warp each)
GRAD_COLS = 32    # parameter-gradient block: 32 columns ...
GRAD_LANES = 8    # ... x 8 row lanes, as bias_act's backward
GRAD_ROWS = 128   # rows per chunk (at most) that one block sums into a float64 partial


@cuda.jit(device=True)
def _row_sum(acc, row):
    """acc[row, 0] + ... + acc[row, LANES - 1], left to right: a fixed order."""
    s = acc[row, 0]
    for k in range(1, LANES):
        s += acc[row, k]
    return s


@cuda.jit
def _layernorm_forward_kernel(x, weight, bias, out, mean, rstd, eps):
    # Memory-bound: the row is read three times (twice from L1) and its sums
    # run in float64 at no cost in time. Blocks step over groups of ROWS rows;
    # the loop bound is block-uniform, so every thread reaches every barrier.
    N, C = x.shape
    lane, row = cuda.threadIdx.x, cuda.threadIdx.y
    acc = cuda.shared.array((ROWS, LANES), float64)  # the lanes' shares
    res = cuda.shared.array((ROWS, 2), float64)      # mean, rstd: lane 0 -> all lanes
    base = cuda.blockIdx.x * ROWS
    while base < N:
        i = base + row
        width = C if i < N else 0  # a row past N: no channels, but every barrier
        s = float64(0.0)  # the mean
        for c in range(lane, width, LANES):
            s += x[i, c]
        acc[row, lane] = s
        cuda.syncthreads()
        if lane == 0:
            res[row, 0] = _row_sum(acc, row) / C
        cuda.syncthreads()
        m = res[row, 0]
        s = float64(0.0)  # the centred sum of squares: no E[x^2] - E[x]^2 cancellation
        for c in range(lane, width, LANES):
            d = x[i, c] - m
            s += d * d
        acc[row, lane] = s  # lane 0 read the first shares before the last barrier
        cuda.syncthreads()
        if lane == 0:
            res[row, 1] = 1.0 / math.sqrt(_row_sum(acc, row) / C + eps)
        cuda.syncthreads()
        r = res[row, 1]
        for c in range(lane, width, LANES):
            out[i, c] = (x[i, c] - m) * r * weight[c] + bias[c]
        if i < N and lane == 0:
            mean[i] = m
            rstd[i] = r
        base += cuda.gridDim.x * ROWS


@cuda.jit
def _layernorm_param_partials_kernel(dout, x, mean, rstd, pw, pb):
    # block (GRAD_COLS, GRAD_LANES) owns columns c0..c0+31 of row chunk blockIdx.y
    # (the launcher picks the number of chunks: gridDim.y)
    N, C = x.shape
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    c = cuda.blockIdx.x * GRAD_COLS + tx
    rows = -(-N // cuda.gridDim.y)
    r0 = cuda.blockIdx.y * rows
    aw = cuda.shared.array((GRAD_LANES, GRAD_COLS), float64)
    ab = cuda.shared.array((GRAD_LANES, GRAD_COLS), float64)
    sw = sb = float64(0.0)
    if c < C:
        r = r0 + ty
        while r < min(N, r0 + rows):
            d = dout[r, c]
            xhat = (x[r, c] - mean[r]) * rstd[r]  # in x's dtype, as the twin
            sw += float64(d) * xhat
            sb += d
            r += GRAD_LANES
    aw[ty, tx] = sw
    ab[ty, tx] = sb
    cuda.syncthreads()
    if ty == 0 and c < C:  # the row lanes' sums, in lane order
        for k in range(1, GRAD_LANES):
            sw += aw[k, tx]
            sb += ab[k, tx]
        pw[cuda.blockIdx.y, c] = sw
        pb[cuda.blockIdx.y, c] = sb


@cuda.jit
def _layernorm_param_sums_kernel(pw, pb, dweight, dbias, accumulate):
    # one thread per column sums the row-chunk partials in order (no atomics)
    c = cuda.grid(1)
    while c < dweight.size:
        sw = sb = float64(0.0)
        for g in range(pw.shape[0]):
            sw += pw[g, c]
            sb += pb[g, c]
        dweight[c] = dweight[c] + sw if accumulate else sw
        dbias[c] = dbias[c] + sb if accumulate else sb
        c += cuda.gridsize(1)


@cuda.jit
def _layernorm_dx_kernel(dout, x, weight, mean, rstd, dx, add_dx):
    # rows as the forward; each lane reads its dout elements before writing the
    # same elements of dx, so dx may be dout. xhat and g = dout * weight are
    # formed in x's dtype (as the twin), their row sums and dx in float64.
    N, C = x.shape
    lane, row = cuda.threadIdx.x, cuda.threadIdx.y
    ag = cuda.shared.array((ROWS, LANES), float64)
    agx = cuda.shared.array((ROWS, LANES), float64)
    res = cuda.shared.array((ROWS, 2), float64)  # mean(g), mean(g xhat): lane 0 -> all lanes
    base = cuda.blockIdx.x * ROWS
    while base < N:
        i = base + row
        width = C if i < N else 0  # a row past N: no channels, but every barrier
        sg = sgx = float64(0.0)  # sums of g and g xhat
        for c in range(lane, width, LANES):
            g = float64(dout[i, c] * weight[c])
            sg += g
            sgx += g * ((x[i, c] - mean[i]) * rstd[i])
        ag[row, lane] = sg
        agx[row, lane] = sgx
        cuda.syncthreads()
        if lane == 0:
            res[row, 0] = _row_sum(ag, row) / C
            res[row, 1] = _row_sum(agx, row) / C
        cuda.syncthreads()
        g_mean, gx_mean = res[row, 0], res[row, 1]
        for c in range(lane, width, LANES):
            g = float64(dout[i, c] * weight[c])
            v = (g - g_mean - float64((x[i, c] - mean[i]) * rstd[i]) * gx_mean) * rstd[i]
            if add_dx:
                dx[i, c] += v
            else:
                dx[i, c] = v
        base += cuda.gridDim.x * ROWS


# ---- launchers ---------------------------------------------------------------------
def layernorm_forward_cuda(x, weight, bias, out, mean, rstd, eps=1e-5, *, stream=0):
    """As :func:`layernorm_forward`, on ``stream``. Returns out."""
    N, _ = x.shape
    _layernorm_forward_kernel[blocks_for(N, ROWS), (LANES, ROWS), stream](
        x, weight, bias, out, mean, rstd, np.float64(eps))
    return out


def layernorm_backward_cuda(dout, x, weight, mean, rstd, dx, dweight, dbias, accumulate=False, add_dx=False, *,
                            stream=0, scratch):
    """As :func:`layernorm_backward`, on ``stream``; dx may be dout. Returns dx.

    ``scratch(key, shape, dtype)`` lends the two float64 (ceil(N / GRAD_ROWS), C)
    partial sums of dweight and dbias.
    """
    N, C = x.shape
    chunks = max(1, -(-N // GRAD_ROWS))
    if chunks > 65535:  # gridDim.y limit
        raise ValueError(f"layernorm_backward with N={N} rows exceeds {65535 * GRAD_ROWS}; split the batch")
    pw = scratch("ln_dweight_partial", (chunks, C), np.float64)
    pb = scratch("ln_dbias_partial", (chunks, C), np.float64)
    # the parameter gradients first: they read all of dout, which the dx kernel may overwrite
    _layernorm_param_partials_kernel[(-(-C // GRAD_COLS), chunks), (GRAD_COLS, GRAD_LANES), stream](
        dout, x, mean, rstd, pw, pb)
    _layernorm_param_sums_kernel[blocks_for(C), THREADS, stream](pw, pb, dweight, dbias, bool(accumulate))
    _layernorm_dx_kernel[blocks_for(N, ROWS), (LANES, ROWS), stream](
        dout, x, weight, mean, rstd, dx, bool(add_dx))
    return dx

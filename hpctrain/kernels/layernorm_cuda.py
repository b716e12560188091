"""The CUDA kernels of layernorm.py (the contract, shapes and float64 rules in its docstring),
launched by layernorm.py.

A warp per row, :data:`ROWS` rows per block; lane 0 adds the lanes' shares left to right (two
barriers per sum, not a tree's six). The order is fixed: the same bits on every run, though not the
twin's. dweight and dbias: float64 partial column sums per chunk of up to :data:`GRAD_ROWS` rows,
then one ordered sum per column by the last block of its column tile to finish, in the same launch
(no float atomics); that kernel runs before the dx kernel, so dx may alias dout. Each lane loads its
channels four at a time before it adds or stores any (cuda_support.UNROLL), in the same order as one
at a time.
"""

from __future__ import annotations

import math

from numba import cuda, float64, int32

from .support.column_sums_cuda import last_block_of_column, sum_column_partials

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


@cuda.jit(device=True)
def _lane_sum(x, i, lane, width):
    """float64 sum of x[i, lane], x[i, lane + LANES], ... below ``width``, in that order,
    four loaded ahead of their adds (cuda_support.UNROLL)."""
    s = float64(0.0)
    c = lane
    while c + 3 * LANES < width:
        a0, a1, a2, a3 = x[i, c], x[i, c + LANES], x[i, c + 2 * LANES], x[i, c + 3 * LANES]
        s += a0
        s += a1
        s += a2
        s += a3
        c += 4 * LANES
    while c < width:
        s += x[i, c]
        c += LANES
    return s


@cuda.jit(device=True)
def _lane_centred_squares(x, i, m, lane, width):
    """float64 sum of (x[i, c] - m)^2 over the lane's channels, as :func:`_lane_sum`."""
    s = float64(0.0)
    c = lane
    while c + 3 * LANES < width:
        a0, a1, a2, a3 = x[i, c] - m, x[i, c + LANES] - m, x[i, c + 2 * LANES] - m, x[i, c + 3 * LANES] - m
        s += a0 * a0
        s += a1 * a1
        s += a2 * a2
        s += a3 * a3
        c += 4 * LANES
    while c < width:
        d = x[i, c] - m
        s += d * d
        c += LANES
    return s


@cuda.jit(device=True)
def _put_dx(dx, i, c, g, xc, mi, ri, g_mean, gx_mean, add_dx):
    """dx[i, c] (+)= (g - mean(g) - xhat mean(g xhat)) rstd; g and xhat in x's dtype, the rest float64."""
    v = (float64(g) - g_mean - float64((xc - mi) * ri) * gx_mean) * ri
    if add_dx:
        dx[i, c] += v
    else:
        dx[i, c] = v


@cuda.jit(device=True)
def _lane_sum_of_sum(a, b, x, i, lane, width):
    """:func:`_lane_sum` of x = a + b, each x[i, c] stored as it is formed (the residual add,
    rounded to the dtype as residual_forward's kernel rounds it)."""
    s = float64(0.0)
    c = lane
    while c + 3 * LANES < width:
        a0, a1, a2, a3 = a[i, c], a[i, c + LANES], a[i, c + 2 * LANES], a[i, c + 3 * LANES]
        b0, b1, b2, b3 = b[i, c], b[i, c + LANES], b[i, c + 2 * LANES], b[i, c + 3 * LANES]
        x0, x1, x2, x3 = a0 + b0, a1 + b1, a2 + b2, a3 + b3   # in the dtype: the residual kernel's rounding
        x[i, c], x[i, c + LANES], x[i, c + 2 * LANES], x[i, c + 3 * LANES] = x0, x1, x2, x3
        s += x0
        s += x1
        s += x2
        s += x3
        c += 4 * LANES
    while c < width:
        x0 = a[i, c] + b[i, c]
        x[i, c] = x0
        s += x0
        c += LANES
    return s


def _forward_kernel(residual: bool):
    """The forward kernel; ``residual``: it first forms x = a + b (and stores it), else a and b
    are unused. One body, so the fused op normalises exactly as the plain one."""

    @cuda.jit
    def kernel(a, b, x, weight, bias, out, mean, rstd, eps):
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
            # the mean (a lane reads back only the x[i, c] it stored itself)
            s = _lane_sum_of_sum(a, b, x, i, lane, width) if residual else _lane_sum(x, i, lane, width)
            acc[row, lane] = s
            cuda.syncthreads()
            if lane == 0:
                res[row, 0] = _row_sum(acc, row) / C
            cuda.syncthreads()
            m = res[row, 0]
            s = _lane_centred_squares(x, i, m, lane, width)  # no E[x^2] - E[x]^2 cancellation
            acc[row, lane] = s  # lane 0 read the first shares before the last barrier
            cuda.syncthreads()
            if lane == 0:
                res[row, 1] = 1.0 / math.sqrt(_row_sum(acc, row) / C + eps)
            cuda.syncthreads()
            r = res[row, 1]
            c = lane
            while c + 3 * LANES < width:  # four loaded before any is stored (cuda_support.UNROLL)
                x0, x1, x2, x3 = x[i, c], x[i, c + LANES], x[i, c + 2 * LANES], x[i, c + 3 * LANES]
                out[i, c] = (x0 - m) * r * weight[c] + bias[c]
                out[i, c + LANES] = (x1 - m) * r * weight[c + LANES] + bias[c + LANES]
                out[i, c + 2 * LANES] = (x2 - m) * r * weight[c + 2 * LANES] + bias[c + 2 * LANES]
                out[i, c + 3 * LANES] = (x3 - m) * r * weight[c + 3 * LANES] + bias[c + 3 * LANES]
                c += 4 * LANES
            while c < width:
                out[i, c] = (x[i, c] - m) * r * weight[c] + bias[c]
                c += LANES
            if i < N and lane == 0:
                mean[i] = m
                rstd[i] = r
            base += cuda.gridDim.x * ROWS
    return kernel


layernorm_forward_kernel = _forward_kernel(False)
residual_layernorm_forward_kernel = _forward_kernel(True)


@cuda.jit
def layernorm_param_grads_kernel(dout, x, mean, rstd, pw, pb, counters, dweight, dbias, accumulate):
    # block (GRAD_COLS, GRAD_LANES) owns columns c0..c0+31 of row chunk blockIdx.y
    # (the launcher picks the number of chunks: gridDim.y); the last block of a column tile
    # to finish adds the chunks' partials in chunk order (column_sums_cuda.last_block_of_column)
    N, C = x.shape
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    c = cuda.blockIdx.x * GRAD_COLS + tx
    rows = -(-N // cuda.gridDim.y)
    r0 = cuda.blockIdx.y * rows
    aw = cuda.shared.array((GRAD_LANES, GRAD_COLS), float64)
    ab = cuda.shared.array((GRAD_LANES, GRAD_COLS), float64)
    last = cuda.shared.array(1, int32)
    sw = sb = float64(0.0)
    if c < C:
        end = min(N, r0 + rows)
        r = r0 + ty
        while r + 3 * GRAD_LANES < end:  # four rows loaded ahead, summed in row order
            d0, d1 = dout[r, c], dout[r + GRAD_LANES, c]
            d2, d3 = dout[r + 2 * GRAD_LANES, c], dout[r + 3 * GRAD_LANES, c]
            y0, y1 = x[r, c], x[r + GRAD_LANES, c]
            y2, y3 = x[r + 2 * GRAD_LANES, c], x[r + 3 * GRAD_LANES, c]
            h0 = (y0 - mean[r]) * rstd[r]  # xhat in x's dtype, as the twin
            h1 = (y1 - mean[r + GRAD_LANES]) * rstd[r + GRAD_LANES]
            h2 = (y2 - mean[r + 2 * GRAD_LANES]) * rstd[r + 2 * GRAD_LANES]
            h3 = (y3 - mean[r + 3 * GRAD_LANES]) * rstd[r + 3 * GRAD_LANES]
            sw += float64(d0) * h0
            sb += d0
            sw += float64(d1) * h1
            sb += d1
            sw += float64(d2) * h2
            sb += d2
            sw += float64(d3) * h3
            sb += d3
            r += 4 * GRAD_LANES
        while r < end:
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
    if last_block_of_column(counters, last, tx + ty):
        if ty == 0 and c < C:
            sw, sb = sum_column_partials(pw, c), sum_column_partials(pb, c)
            dweight[c] = dweight[c] + sw if accumulate else sw
            dbias[c] = dbias[c] + sb if accumulate else sb


@cuda.jit
def layernorm_dx_kernel(dout, x, weight, mean, rstd, dx, add_dx):
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
        mi, ri = mean[min(i, N - 1)], rstd[min(i, N - 1)]  # a row past N reads row N - 1's, unused
        c = lane
        while c + 3 * LANES < width:  # four loaded ahead, summed in channel order
            g0, g1 = dout[i, c], dout[i, c + LANES]
            g2, g3 = dout[i, c + 2 * LANES], dout[i, c + 3 * LANES]
            x0, x1, x2, x3 = x[i, c], x[i, c + LANES], x[i, c + 2 * LANES], x[i, c + 3 * LANES]
            g = float64(g0 * weight[c])
            sg += g
            sgx += g * ((x0 - mi) * ri)
            g = float64(g1 * weight[c + LANES])
            sg += g
            sgx += g * ((x1 - mi) * ri)
            g = float64(g2 * weight[c + 2 * LANES])
            sg += g
            sgx += g * ((x2 - mi) * ri)
            g = float64(g3 * weight[c + 3 * LANES])
            sg += g
            sgx += g * ((x3 - mi) * ri)
            c += 4 * LANES
        while c < width:
            g = float64(dout[i, c] * weight[c])
            sg += g
            sgx += g * ((x[i, c] - mi) * ri)
            c += LANES
        ag[row, lane] = sg
        agx[row, lane] = sgx
        cuda.syncthreads()
        if lane == 0:
            res[row, 0] = _row_sum(ag, row) / C
            res[row, 1] = _row_sum(agx, row) / C
        cuda.syncthreads()
        g_mean, gx_mean = res[row, 0], res[row, 1]
        c = lane
        while c + 3 * LANES < width:  # four loaded before any dx is stored (dx may be dout)
            g0, g1 = dout[i, c], dout[i, c + LANES]
            g2, g3 = dout[i, c + 2 * LANES], dout[i, c + 3 * LANES]
            x0, x1, x2, x3 = x[i, c], x[i, c + LANES], x[i, c + 2 * LANES], x[i, c + 3 * LANES]
            _put_dx(dx, i, c, g0 * weight[c], x0, mi, ri, g_mean, gx_mean, add_dx)
            _put_dx(dx, i, c + LANES, g1 * weight[c + LANES], x1, mi, ri, g_mean, gx_mean, add_dx)
            _put_dx(dx, i, c + 2 * LANES, g2 * weight[c + 2 * LANES], x2, mi, ri, g_mean, gx_mean, add_dx)
            _put_dx(dx, i, c + 3 * LANES, g3 * weight[c + 3 * LANES], x3, mi, ri, g_mean, gx_mean, add_dx)
            c += 4 * LANES
        while c < width:
            _put_dx(dx, i, c, dout[i, c] * weight[c], x[i, c], mi, ri, g_mean, gx_mean, add_dx)
            c += LANES
        base += cuda.gridDim.x * ROWS

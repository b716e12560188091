"""Bias add + activation, fused: the elementwise half of a Linear layer.

forward:  z (B, O) holds x @ w; z <- z + b (the pre-activation, kept for
          backward); out <- act(z). With act "identity", ``out`` may be ``z``.
backward: dz <- dout * act'(z); db <- sum over rows of dz (or db += ... when
          ``accumulate``). ``dz`` may be ``dout`` (each element is read before
          it is written).
act is "identity", "relu" or "gelu" (tanh approximation, as GPT-2 and llm.c:
gelu(v) = 0.5 v (1 + tanh(u)), u = k (v + 0.044715 v^3), k = sqrt(2/pi); relu's
subgradient at 0 is 0). GELU is evaluated through the identity
0.5 (1 + tanh(u)) = s = 1 / (1 + exp(-2u)), so gelu(v) = v s and
gelu'(v) = s + 2 v s (1 - s) k (1 + 3 * 0.044715 v^2): the same function, but
without the cancellation in 1 + tanh(u) for v < 0 that costs the tanh form up
to ~1e-4 relative in float32 (and exp vectorises where tanh does not).

float32 stays float32: the activations are built per dtype with constants of
that dtype (a Python float literal would promote float32 arithmetic to
float64 in numba), so the twin and the kernels both round every step in the
array's dtype. Column sums (the bias gradient) accumulate in float64: B
additions in float32 would lose log2(B) bits, and they are cheap beside the
element pass.

The activations are plain Python functions: the CUDA kernels compile them
(``numba.cuda.jit(device=True)``), and so does the CPU twin's ReLU loop
(``numba.njit``). The twin's identity is a NumPy broadcast add (plus a column-sum
loop backward) and its GELU runs NumPy's SIMD exp between two numba passes: the
same formula in the same dtype as the kernels, only vectorised (a scalar libm
call in a loop does not vectorise). They live in this file because numba's disk
cache only notices edits to the file of the function it cached.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float64, njit

from .cuda_support import row_grid

# ---- activations (plain Python, compiled for both targets) -------------------------
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def gelu_constants(dtype):
    """(k, c, 3c, 0.5, 1, -2) in ``dtype``: the GELU's constants, typed so float32 math stays float32."""
    t = np.dtype(dtype).type
    return t(_K), t(_C), t(3.0 * _C), t(0.5), t(1.0), t(-2.0)


@lru_cache(maxsize=None)
def activations(dtype_name: str) -> dict:
    """{"identity" | "relu" | "gelu": (act, act')} for one float dtype, constants of that dtype."""
    k, c, c3, half, one, m2 = gelu_constants(dtype_name)
    zero = np.dtype(dtype_name).type(0.0)

    def identity(v):
        return v

    def identity_grad(v):
        return one

    def relu(v):
        return v if v > zero else zero

    def relu_grad(v):
        return one if v > zero else zero

    def gelu(v):
        s = one / (one + math.exp(m2 * k * (v + c * v * v * v)))
        return v * s

    def gelu_grad(v):
        s = one / (one + math.exp(m2 * k * (v + c * v * v * v)))
        return s - m2 * v * s * (one - s) * k * (one + c3 * v * v)

    return {"identity": (identity, identity_grad), "relu": (relu, relu_grad), "gelu": (gelu, gelu_grad)}


# ---- CPU twin (numba + NumPy) -------------------------------------------------------
@lru_cache(maxsize=None)
def _relu_cpu(dtype_name: str):
    relu, relu_grad = (njit(f) for f in activations(dtype_name)["relu"])

    @njit(nogil=True)
    def forward(z, b, out):
        B, O = z.shape
        for r in range(B):
            for c in range(O):
                t = z[r, c] + b[c]
                z[r, c] = t
                out[r, c] = relu(t)

    @njit(nogil=True)
    def backward(dout, z, dz, db, accumulate):
        B, O = z.shape
        sums = np.zeros(O)  # float64
        for r in range(B):
            for c in range(O):
                d = dout[r, c] * relu_grad(z[r, c])
                dz[r, c] = d
                sums[c] += d
        for c in range(O):
            db[c] = db[c] + sums[c] if accumulate else sums[c]

    return forward, backward


# GELU: a scalar libm exp in a numba loop does not vectorise, so exp runs as NumPy's SIMD ufunc
# over a block of rows and numba does the vectorisable arithmetic around it, one pass before
# and one after. The work array has z's dtype (float32 math for float32); blocks of about
# GELU_BLOCK elements keep it in L2. ``K`` is gelu_constants(z.dtype).
GELU_BLOCK = 1 << 15


@njit(cache=True, nogil=True)
def _gelu_exponent(z, r0, e, K):
    """e[i, c] <- -2 k (z + c z^3) of row r0 + i (exp of it is 1/s - 1)."""
    k, c, _, _, _, m2 = K
    for i in range(e.shape[0]):
        for j in range(e.shape[1]):
            v = z[r0 + i, j]
            e[i, j] = m2 * k * (v + c * v * v * v)


@njit(cache=True, nogil=True)
def _gelu_out(z, e, r0, out, K):
    """out <- z s for the block's rows, e = exp(-2u)."""
    one = K[4]
    for i in range(e.shape[0]):
        for j in range(e.shape[1]):
            out[r0 + i, j] = z[r0 + i, j] * (one / (one + e[i, j]))


@njit(cache=True, nogil=True)
def _gelu_grad_out(dout, z, e, r0, dz, sums, K):
    """dz <- dout * gelu'(z) for the block's rows; sums (float64) += their columns, rows in order."""
    k, _, c3, _, one, m2 = K
    for i in range(e.shape[0]):
        for j in range(e.shape[1]):
            v = z[r0 + i, j]
            s = one / (one + e[i, j])
            d = dout[r0 + i, j] * (s - m2 * v * s * (one - s) * k * (one + c3 * v * v))
            dz[r0 + i, j] = d
            sums[j] += d


def _gelu_blocks(z):
    K = gelu_constants(z.dtype)
    rows = max(1, GELU_BLOCK // max(1, z.shape[1]))
    work = np.empty((min(rows, z.shape[0]), z.shape[1]), z.dtype)
    for r in range(0, z.shape[0], rows):
        e = work[:min(rows, z.shape[0] - r)]
        _gelu_exponent(z, r, e, K)
        with np.errstate(over="ignore"):  # v << 0: exp overflows to inf, s = 0, gelu = -0 (exact limit)
            np.exp(e, out=e)
        yield r, e, K


def _gelu_forward(z, out):
    for r, e, K in _gelu_blocks(z):
        _gelu_out(z, e, r, out, K)


def _gelu_backward(dout, z, dz, db, accumulate):
    sums = np.zeros(z.shape[1])
    for r, e, K in _gelu_blocks(z):
        _gelu_grad_out(dout, z, e, r, dz, sums, K)
    db[...] = db + sums if accumulate else sums


@njit(cache=True, nogil=True)
def _column_sums(d, sums):
    """sums (float64) += the columns of d, rows in order (a loop LLVM vectorises across columns)."""
    for r in range(d.shape[0]):
        for c in range(d.shape[1]):
            sums[c] += d[r, c]


def bias_act_forward(z, b, out, act):
    """z (B, O) += b (O,); out (B, O) <- act(z). Returns out."""
    if act == "identity":  # the plain bias add vectorises; the generic loop's per-element branch does not
        np.add(z, b, out=z)
        if out is not z:
            out[...] = z
        return out
    if act == "gelu":
        z += b
        _gelu_forward(z, out)
        return out
    if act != "relu":
        raise ValueError(f"activation {act!r}: choose identity, relu or gelu")
    _relu_cpu(z.dtype.name)[0](z, b, out)
    return out


def bias_act_backward(dout, z, dz, db, act, accumulate=False):
    """dz (B, O) <- dout * act'(z); db (O,) <- (db +) column sums of dz. Returns dz."""
    if act == "identity":
        if dz is not dout:
            dz[...] = dout
        sums = np.zeros(dout.shape[1])
        _column_sums(dout, sums)
        db[...] = db + sums if accumulate else sums
        return dz
    if act == "gelu":
        _gelu_backward(dout, z, dz, db, bool(accumulate))
        return dz
    if act != "relu":
        raise ValueError(f"activation {act!r}: choose identity, relu or gelu")
    _relu_cpu(z.dtype.name)[1](dout, z, dz, db, bool(accumulate))
    return dz


# ---- CUDA kernels ------------------------------------------------------------------
COLS = 32          # backward block: 32 columns (one warp, coalesced rows) ...
LANES = 8          # ... x 8 row lanes
ROWS_PER_BLOCK = 128  # rows one backward block sums; partial sums go to scratch


def _make_cuda(act, grad):
    @cuda.jit
    def forward(z, b, out):
        # threads across columns, block rows over rows (row_grid): no index division per
        # element, and UNROLL (4) rows loaded before any is stored (cuda_support.UNROLL)
        B, O = z.shape
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if c >= O:
            return
        bc = b[c]
        s = cuda.gridDim.y
        r = cuda.blockIdx.y
        while r + 3 * s < B:
            t0 = z[r, c] + bc
            t1 = z[r + s, c] + bc
            t2 = z[r + 2 * s, c] + bc
            t3 = z[r + 3 * s, c] + bc
            z[r, c] = t0
            z[r + s, c] = t1
            z[r + 2 * s, c] = t2
            z[r + 3 * s, c] = t3
            out[r, c] = act(t0)
            out[r + s, c] = act(t1)
            out[r + 2 * s, c] = act(t2)
            out[r + 3 * s, c] = act(t3)
            r += 4 * s
        while r < B:
            t = z[r, c] + bc
            z[r, c] = t
            out[r, c] = act(t)
            r += s

    @cuda.jit
    def backward_partial(dout, z, dz, partial):
        # block (COLS, LANES) owns columns c0..c0+31 of rows [r0, r0 + ROWS_PER_BLOCK); a
        # lane's rows go four at a time, loaded before any dz is stored (cuda_support.UNROLL)
        # and added to s in row order, as one at a time would
        B, O = z.shape
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        c = cuda.blockIdx.x * COLS + tx
        r0 = cuda.blockIdx.y * ROWS_PER_BLOCK
        acc = cuda.shared.array((LANES, COLS), float64)
        s = 0.0
        if c < O:
            end = min(B, r0 + ROWS_PER_BLOCK)
            r = r0 + ty
            while r + 3 * LANES < end:
                g0, g1 = dout[r, c], dout[r + LANES, c]
                g2, g3 = dout[r + 2 * LANES, c], dout[r + 3 * LANES, c]
                v0, v1 = z[r, c], z[r + LANES, c]
                v2, v3 = z[r + 2 * LANES, c], z[r + 3 * LANES, c]
                d0, d1, d2, d3 = g0 * grad(v0), g1 * grad(v1), g2 * grad(v2), g3 * grad(v3)
                dz[r, c] = d0
                dz[r + LANES, c] = d1
                dz[r + 2 * LANES, c] = d2
                dz[r + 3 * LANES, c] = d3
                s += d0
                s += d1
                s += d2
                s += d3
                r += 4 * LANES
            while r < end:
                d = dout[r, c] * grad(z[r, c])
                dz[r, c] = d
                s += d
                r += LANES
        acc[ty, tx] = s
        cuda.syncthreads()
        # tree over the row lanes: fixed order, so the result is deterministic
        half = LANES // 2
        while half > 0:
            if ty < half:
                acc[ty, tx] += acc[ty + half, tx]
            cuda.syncthreads()
            half //= 2
        if ty == 0 and c < O:
            partial[cuda.blockIdx.y, c] = acc[0, tx]

    return forward, backward_partial


@cuda.jit
def _sum_partials(partial, db, accumulate):
    # one thread per column sums the row-chunk partials in order (no atomics), four
    # loaded ahead of their adds (cuda_support.UNROLL)
    c = cuda.grid(1)
    if c < db.shape[0]:
        n = partial.shape[0]
        s = 0.0
        g = 0
        while g + 3 < n:
            p0, p1, p2, p3 = partial[g, c], partial[g + 1, c], partial[g + 2, c], partial[g + 3, c]
            s += p0
            s += p1
            s += p2
            s += p3
            g += 4
        while g < n:
            s += partial[g, c]
            g += 1
        db[c] = db[c] + s if accumulate else s


@lru_cache(maxsize=None)
def cuda_kernels(act: str, dtype_name: str):
    """(forward, backward_partial) kernels of ``act`` for one float dtype."""
    f, df = activations(dtype_name)[act]
    return _make_cuda(cuda.jit(device=True)(f), cuda.jit(device=True)(df))


# ---- launchers ---------------------------------------------------------------------
def _check_act(act):
    if act not in ("identity", "relu", "gelu"):
        raise ValueError(f"activation {act!r}: choose identity, relu or gelu")


def bias_act_forward_cuda(z, b, out, act, *, stream=0):
    B, O = z.shape
    _check_act(act)
    grid, threads = row_grid(B, O)
    cuda_kernels(act, z.dtype.name)[0][grid, threads, stream](z, b, out)
    return out


def partial_shape(B, O):
    """Shape of the float64 scratch ``bias_act_backward_cuda`` needs for dz (B, O)."""
    return (max(1, -(-B // ROWS_PER_BLOCK)), O)


def bias_act_backward_cuda(dout, z, dz, db, act, accumulate=False, *, stream=0, scratch):
    """As :func:`bias_act_backward`; ``scratch(key, shape, dtype)`` lends a reusable device array."""
    B, O = z.shape
    _check_act(act)
    partial = scratch("bias_partial", partial_shape(B, O), np.float64)
    if partial.shape[0] > 65535:  # gridDim.y limit
        raise ValueError(f"bias_act_backward with B={B} rows exceeds {65535 * ROWS_PER_BLOCK}; split the batch")
    grid = (-(-O // COLS), partial.shape[0])
    cuda_kernels(act, z.dtype.name)[1][grid, (COLS, LANES), stream](dout, z, dz, partial)
    _sum_partials[-(-O // 256), 256, stream](partial, db, bool(accumulate))
    return dz

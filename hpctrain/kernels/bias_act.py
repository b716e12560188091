"""Bias add + activation, fused: the elementwise half of a Linear layer.

forward:  z (B, O) holds x @ w; z <- z + b (the pre-activation, kept for
          backward); out <- act(z). With act "identity", ``out`` may be ``z``.
backward: dz <- dout * act'(z); db <- sum over rows of dz (or db += ... when
          ``accumulate``). ``dz`` may be ``dout`` (each element is read before
          it is written).
act is "identity", "relu" or "gelu" (tanh approximation, as GPT-2 and llm.c:
gelu(v) = 0.5 v (1 + tanh(k (v + 0.044715 v^3))), k = sqrt(2/pi); relu's
subgradient at 0 is 0). Column sums accumulate in float64 so the bias
gradient does not lose bits to B additions.

The activations are plain Python functions: the CUDA kernels compile them
(``numba.cuda.jit(device=True)``), and so does the CPU twin's ReLU loop
(``numba.njit``). The twin's identity is a NumPy broadcast add (plus a column-sum
loop backward) and its GELU runs NumPy's SIMD tanh between two numba passes: the
same formula, evaluated in float64 and rounded once on store, as the kernels do,
only vectorised (scalar libm tanh in a loop does not vectorise). They live in
this file because numba's disk cache only notices edits to the file of the
function it cached.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float64, njit

from .cuda_support import blocks_for

# ---- activations (plain Python, compiled for both targets) -------------------------
_K = math.sqrt(2.0 / math.pi)


def _identity(v):
    return v


def _identity_grad(v):
    return 1.0


def _relu(v):
    return v if v > 0 else 0.0


def _relu_grad(v):
    return 1.0 if v > 0 else 0.0


def _gelu(v):
    return 0.5 * v * (1.0 + math.tanh(_K * (v + 0.044715 * v * v * v)))


def _gelu_grad(v):
    t = math.tanh(_K * (v + 0.044715 * v * v * v))
    dt = _K * (1.0 + 3.0 * 0.044715 * v * v)
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * dt


ACTIVATIONS = {"identity": (_identity, _identity_grad), "relu": (_relu, _relu_grad), "gelu": (_gelu, _gelu_grad)}


# ---- CPU twin (numba + NumPy) -------------------------------------------------------
_relu_cpu, _relu_grad_cpu = njit(_relu), njit(_relu_grad)


@njit(cache=True, nogil=True)
def _bias_relu_forward(z, b, out):
    B, O = z.shape
    for r in range(B):
        for c in range(O):
            t = z[r, c] + b[c]
            z[r, c] = t
            out[r, c] = _relu_cpu(t)


@njit(cache=True, nogil=True)
def _bias_relu_backward(dout, z, dz, db, accumulate):
    B, O = z.shape
    sums = np.zeros(O)  # float64
    for r in range(B):
        for c in range(O):
            d = dout[r, c] * _relu_grad_cpu(z[r, c])
            dz[r, c] = d
            sums[c] += d
    for c in range(O):
        db[c] = db[c] + sums[c] if accumulate else sums[c]


# GELU: the numba loop's scalar libm tanh does not vectorise (2048 x 512 took 18 ms), so tanh
# runs as NumPy's SIMD ufunc over a block of rows and numba does the vectorisable arithmetic
# around it, one pass before and one after (4 ms forward + backward). Still evaluated in float64
# and rounded once on store, as the scalar functions above and the CUDA kernels do; blocks of
# about GELU_BLOCK elements keep the float64 work array in L2.
GELU_BLOCK = 1 << 15


@njit(cache=True, nogil=True)
def _gelu_inner(z, r0, u):
    """u[i, c] <- k (z + 0.044715 z^3) of row r0 + i, in float64."""
    for i in range(u.shape[0]):
        for c in range(u.shape[1]):
            v = float64(z[r0 + i, c])
            u[i, c] = _K * (v + 0.044715 * v * v * v)


@njit(cache=True, nogil=True)
def _gelu_out(z, t, r0, out):
    """out <- 0.5 z (1 + t) for the block's rows, t = tanh of the inner value."""
    for i in range(t.shape[0]):
        for c in range(t.shape[1]):
            v = float64(z[r0 + i, c])
            out[r0 + i, c] = 0.5 * v * (1.0 + t[i, c])


@njit(cache=True, nogil=True)
def _gelu_grad_out(dout, z, t, r0, dz, sums):
    """dz <- dout * gelu'(z) for the block's rows; sums (float64) += their columns, rows in order."""
    for i in range(t.shape[0]):
        for c in range(t.shape[1]):
            v = float64(z[r0 + i, c])
            th = t[i, c]
            g = 0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * _K * (1.0 + 3.0 * 0.044715 * v * v)
            d = dout[r0 + i, c] * g
            dz[r0 + i, c] = d
            sums[c] += d


def _gelu_blocks(z):
    rows = max(1, GELU_BLOCK // max(1, z.shape[1]))
    work = np.empty((min(rows, z.shape[0]), z.shape[1]))  # float64
    for r in range(0, z.shape[0], rows):
        t = work[:min(rows, z.shape[0] - r)]
        _gelu_inner(z, r, t)
        np.tanh(t, out=t)
        yield r, t


def _gelu_forward(z, out):
    for r, t in _gelu_blocks(z):
        _gelu_out(z, t, r, out)


def _gelu_backward(dout, z, dz, db, accumulate):
    sums = np.zeros(z.shape[1])
    for r, t in _gelu_blocks(z):
        _gelu_grad_out(dout, z, t, r, dz, sums)
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
    _bias_relu_forward(z, b, out)
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
    _bias_relu_backward(dout, z, dz, db, bool(accumulate))
    return dz


# ---- CUDA kernels ------------------------------------------------------------------
COLS = 32          # backward block: 32 columns (one warp, coalesced rows) ...
LANES = 8          # ... x 8 row lanes
ROWS_PER_BLOCK = 128  # rows one backward block sums; partial sums go to scratch


def _make_cuda(act, grad):
    @cuda.jit
    def forward(z, b, out):
        B, O = z.shape
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < B * O:
            r, c = i // O, i % O
            t = z[r, c] + b[c]
            z[r, c] = t
            out[r, c] = act(t)
            i += stride

    @cuda.jit
    def backward_partial(dout, z, dz, partial):
        # block (COLS, LANES) owns columns c0..c0+31 of rows [r0, r0 + ROWS_PER_BLOCK)
        B, O = z.shape
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        c = cuda.blockIdx.x * COLS + tx
        r0 = cuda.blockIdx.y * ROWS_PER_BLOCK
        acc = cuda.shared.array((LANES, COLS), float64)
        s = 0.0
        if c < O:
            r = r0 + ty
            while r < min(B, r0 + ROWS_PER_BLOCK):
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
    # one thread per column sums the row-chunk partials in order (no atomics)
    c = cuda.grid(1)
    if c < db.shape[0]:
        s = 0.0
        for g in range(partial.shape[0]):
            s += partial[g, c]
        db[c] = db[c] + s if accumulate else s


_CUDA = {name: _make_cuda(cuda.jit(device=True)(f), cuda.jit(device=True)(df))
         for name, (f, df) in ACTIVATIONS.items()}


# ---- launchers ---------------------------------------------------------------------
def bias_act_forward_cuda(z, b, out, act, *, stream=0):
    B, O = z.shape
    _CUDA[act][0][blocks_for(B * O), 256, stream](z, b, out)
    return out


def partial_shape(B, O):
    """Shape of the float64 scratch ``bias_act_backward_cuda`` needs for dz (B, O)."""
    return (max(1, -(-B // ROWS_PER_BLOCK)), O)


def bias_act_backward_cuda(dout, z, dz, db, act, accumulate=False, *, stream=0, scratch):
    """As :func:`bias_act_backward`; ``scratch(key, shape, dtype)`` lends a reusable device array."""
    B, O = z.shape
    partial = scratch("bias_partial", partial_shape(B, O), np.float64)
    if partial.shape[0] > 65535:  # gridDim.y limit
        raise ValueError(f"bias_act_backward with B={B} rows exceeds {65535 * ROWS_PER_BLOCK}; split the batch")
    grid = (-(-O // COLS), partial.shape[0])
    _CUDA[act][1][grid, (COLS, LANES), stream](dout, z, dz, partial)
    _sum_partials[-(-O // 256), 256, stream](partial, db, bool(accumulate))
    return dz

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

The activations are plain Python functions compiled twice - ``numba.njit``
for the twin, ``numba.cuda.jit(device=True)`` for the kernels - so both run
the same math. They live in this file because numba's disk cache only notices
edits to the file of the function it cached.
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


# ---- CPU twin (numba) --------------------------------------------------------------
# One compiled function for every activation (selected by index, a per-element
# branch the CPU predicts perfectly): module-level functions, so numba's disk
# cache works (closures specialised per activation would recompile every run).
_ACT_INDEX = {"identity": 0, "relu": 1, "gelu": 2}
_relu_cpu, _relu_grad_cpu = njit(_relu), njit(_relu_grad)
_gelu_cpu, _gelu_grad_cpu = njit(_gelu), njit(_gelu_grad)


@njit(cache=True)
def _act(kind, v):
    if kind == 1:
        return _relu_cpu(v)
    if kind == 2:
        return _gelu_cpu(v)
    return v


@njit(cache=True)
def _act_grad(kind, v):
    if kind == 1:
        return _relu_grad_cpu(v)
    if kind == 2:
        return _gelu_grad_cpu(v)
    return 1.0


@njit(cache=True, nogil=True)
def _bias_act_forward(z, b, out, kind):
    B, O = z.shape
    for r in range(B):
        for c in range(O):
            t = z[r, c] + b[c]
            z[r, c] = t
            out[r, c] = _act(kind, t)


@njit(cache=True, nogil=True)
def _bias_act_backward(dout, z, dz, db, kind, accumulate):
    B, O = z.shape
    sums = np.zeros(O)  # float64
    for r in range(B):
        for c in range(O):
            d = dout[r, c] * _act_grad(kind, z[r, c])
            dz[r, c] = d
            sums[c] += d
    for c in range(O):
        db[c] = db[c] + sums[c] if accumulate else sums[c]


def bias_act_forward(z, b, out, act):
    """z (B, O) += b (O,); out (B, O) <- act(z). Returns out."""
    _bias_act_forward(z, b, out, _ACT_INDEX[act])
    return out


def bias_act_backward(dout, z, dz, db, act, accumulate=False):
    """dz (B, O) <- dout * act'(z); db (O,) <- (db +) column sums of dz. Returns dz."""
    _bias_act_backward(dout, z, dz, db, _ACT_INDEX[act], bool(accumulate))
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

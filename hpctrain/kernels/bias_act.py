"""Bias add + activation, fused: the elementwise half of a Linear layer.

forward:  z (B, O) holds x @ w; z <- z + b (the pre-activation, kept for
          backward); out <- act(z). With act "identity", ``out`` may be ``z``.
backward: dz <- dout * act'(z); db <- sum over rows of dz (or db += ... when
          ``accumulate``). ``dz`` may be ``dout`` (each element is read before
          it is written).
act is "identity", "relu" or "gelu" (see :mod:`.activations`). Column sums
accumulate in float64 so the bias gradient does not lose bits to B additions.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float64, njit

from . import activations
from .cuda_support import blocks_for


# ---- CPU twin (numba) --------------------------------------------------------------
def _make_cpu(act, grad):
    @njit
    def forward(z, b, out):
        B, O = z.shape
        for r in range(B):
            for c in range(O):
                t = z[r, c] + b[c]
                z[r, c] = t
                out[r, c] = act(t)

    @njit
    def backward(dout, z, dz, db, accumulate):
        B, O = z.shape
        sums = np.zeros(O)  # float64
        for r in range(B):
            for c in range(O):
                d = dout[r, c] * grad(z[r, c])
                dz[r, c] = d
                sums[c] += d
        for c in range(O):
            db[c] = db[c] + sums[c] if accumulate else sums[c]

    return forward, backward


_CPU = {name: _make_cpu(*fs) for name, fs in activations.CPU.items()}


def bias_act_forward(z, b, out, act):
    """z (B, O) += b (O,); out (B, O) <- act(z). Returns out."""
    _CPU[act][0](z, b, out)
    return out


def bias_act_backward(dout, z, dz, db, act, accumulate=False):
    """dz (B, O) <- dout * act'(z); db (O,) <- (db +) column sums of dz. Returns dz."""
    _CPU[act][1](dout, z, dz, db, bool(accumulate))
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


_CUDA = {name: _make_cuda(*fs) for name, fs in activations.CUDA.items()}


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
    grid = (-(-O // COLS), partial.shape[0])
    _CUDA[act][1][grid, (COLS, LANES), stream](dout, z, dz, partial)
    _sum_partials[-(-O // 256), 256, stream](partial, db, bool(accumulate))
    return dz

"""Residual connection: the stream x (B, T, C) plus a branch's output.

forward:  out = a + b (out may be a or b: elementwise, read before written).
backward: da <- dout and db <- dout (or += with ``accumulate``); a gradient
          that is None is skipped (its producer needs none).
NumPy does both: one elementwise pass each, nothing for numba to fuse.
The CUDA kernels are grid-stride loops over the flat (contiguous) arrays; with
both gradients wanted, backward reads dout once and writes both. Each element
is one add or copy in the arrays' dtype, so they equal the twin bitwise.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .cuda_support import THREADS, blocks_for


# ---- CPU twin (NumPy) --------------------------------------------------------------
def residual_forward(a, b, out):
    """out <- a + b (same shapes and dtype). Returns out."""
    np.add(a, b, out=out)
    return out


def residual_backward(dout, da, db, accumulate=False):
    """da, db <- (da +, db +) dout; either may be None (skipped). Returns None."""
    for d in (da, db):
        if d is None:
            continue
        if accumulate:
            d += dout
        else:
            d[...] = dout


# ---- CUDA kernels ------------------------------------------------------------------
@cuda.jit
def _residual_forward_kernel(a, b, out):
    i = cuda.grid(1)
    while i < out.size:
        out[i] = a[i] + b[i]  # both read before the write: out may be a or b
        i += cuda.gridsize(1)


@cuda.jit
def _copy_or_add_kernel(dout, d, accumulate):
    i = cuda.grid(1)
    while i < d.size:
        d[i] = d[i] + dout[i] if accumulate else dout[i]
        i += cuda.gridsize(1)


@cuda.jit
def _residual_backward_kernel(dout, da, db, accumulate):
    # both gradients in one pass: dout is read once, not twice
    i = cuda.grid(1)
    while i < dout.size:
        g = dout[i]
        if accumulate:
            da[i] += g
            db[i] += g
        else:
            da[i] = g
            db[i] = g
        i += cuda.gridsize(1)


# ---- launchers ---------------------------------------------------------------------
def _flat(x, like, op, name):
    if x.shape != like.shape or x.dtype != like.dtype:
        raise ValueError(f"{op}: {name} is {x.shape} {x.dtype}, expected {like.shape} {like.dtype} "
                         f"(the residual stream's shape and dtype)")
    return x.reshape(x.size)  # a view: device activations are contiguous


def residual_forward_cuda(a, b, out, *, stream=0):
    """As :func:`residual_forward`, on ``stream``. Returns out."""
    fa, fb, fo = (_flat(x, out, "residual_forward", n) for x, n in ((a, "a"), (b, "b"), (out, "out")))
    _residual_forward_kernel[blocks_for(out.size), THREADS, stream](fa, fb, fo)
    return out


def residual_backward_cuda(dout, da, db, accumulate=False, *, stream=0):
    """As :func:`residual_backward`, on ``stream``; None gradients are skipped. Returns None."""
    wanted = [_flat(d, dout, "residual_backward", n) for d, n in ((da, "da"), (db, "db")) if d is not None]
    if not wanted:
        return
    grid, fd = blocks_for(dout.size), dout.reshape(dout.size)
    if len(wanted) == 2:
        _residual_backward_kernel[grid, THREADS, stream](fd, wanted[0], wanted[1], bool(accumulate))
    else:
        _copy_or_add_kernel[grid, THREADS, stream](fd, wanted[0], bool(accumulate))

"""Residual connection: the stream x (B, T, C) plus a branch's output.

forward:  out = a + b (out may be a or b: elementwise, read before written).
backward: da <- dout and db <- dout (or += with ``accumulate``); a gradient
          that is None is skipped (its producer needs none).
NumPy does both: one elementwise pass each, nothing for numba to fuse.
"""

from __future__ import annotations

import numpy as np


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


# ---- CUDA kernels: not yet (the CudaDevice kernel table lacks these ops) ----

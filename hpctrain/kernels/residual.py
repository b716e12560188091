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

from .support import cpu_threads
from .support.cuda_support import configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.residual_cuda")  # the CUDA kernels launched here (imported at the first launch)


# ---- CPU twin (NumPy) --------------------------------------------------------------
def residual_forward(a, b, out):
    """out <- a + b (same shapes and dtype). Returns out. Rows split over the CPU threads."""
    cpu_threads.for_rows(lambda lo, hi: np.add(a[lo:hi], b[lo:hi], out=out[lo:hi]), out.shape[0], out.size,
                         ns_per_element=0.15)
    return out


def residual_backward(dout, da, db, accumulate=False):
    """da, db <- (da +, db +) dout; either may be None (skipped). Returns None. Rows split over the
    CPU threads."""
    def rows(lo, hi):
        for d in (da, db):
            if d is None:
                continue
            if accumulate:
                d[lo:hi] += dout[lo:hi]
            else:
                d[lo:hi] = dout[lo:hi]
    cpu_threads.for_rows(rows, dout.shape[0], dout.size, ns_per_element=0.2)


# ---- launchers ---------------------------------------------------------------------
def _flat(x, like, op, name):
    if x.shape != like.shape or x.dtype != like.dtype:
        raise ValueError(f"{op}: {name} is {x.shape} {x.dtype}, expected {like.shape} {like.dtype} "
                         f"(the residual stream's shape and dtype)")
    return x.reshape(x.size)  # a view: device activations are contiguous


def residual_forward_cuda(a, b, out, *, stream=0):
    """As :func:`residual_forward`, on ``stream``. Returns out."""
    fa, fb, fo = (_flat(x, out, "residual_forward", n) for x, n in ((a, "a"), (b, "b"), (out, "out")))
    configured_elementwise(kernels.residual_forward_kernel, out.size, stream)(fa, fb, fo)
    return out


def residual_backward_cuda(dout, da, db, accumulate=False, *, stream=0):
    """As :func:`residual_backward`, on ``stream``; None gradients are skipped. Returns None."""
    wanted = [_flat(d, dout, "residual_backward", n) for d, n in ((da, "da"), (db, "db")) if d is not None]
    if not wanted:
        return
    fd = dout.reshape(dout.size)
    if len(wanted) == 2:
        configured_elementwise(kernels.residual_backward_kernel, fd.size, stream)(fd, wanted[0], wanted[1],
                                                                                 bool(accumulate))
    else:
        configured_elementwise(kernels.copy_or_add_kernel, fd.size, stream)(fd, wanted[0], bool(accumulate))

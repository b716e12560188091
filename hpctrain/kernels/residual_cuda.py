"""The CUDA kernels of residual.py: the add forward, the copy or add of the gradient backward, four
elements a grid-stride apart loaded before any is stored (cuda_support.UNROLL). Launched by
residual.py.
"""

from __future__ import annotations

from numba import cuda


# Grid-stride loops over the flat arrays, four elements a stride apart loaded before
# any is stored (cuda_support.UNROLL), then the rest one at a time.
@cuda.jit
def residual_forward_kernel(a, b, out):
    n, i, s = out.size, cuda.grid(1), cuda.gridsize(1)
    while i + 3 * s < n:  # all read before any write: out may be a or b
        x0, x1, x2, x3 = a[i], a[i + s], a[i + 2 * s], a[i + 3 * s]
        y0, y1, y2, y3 = b[i], b[i + s], b[i + 2 * s], b[i + 3 * s]
        out[i] = x0 + y0
        out[i + s] = x1 + y1
        out[i + 2 * s] = x2 + y2
        out[i + 3 * s] = x3 + y3
        i += 4 * s
    while i < n:
        out[i] = a[i] + b[i]
        i += s


@cuda.jit(device=True)
def _put(d, i, g, accumulate):
    if accumulate:
        d[i] += g
    else:
        d[i] = g


@cuda.jit
def copy_or_add_kernel(dout, d, accumulate):
    n, i, s = d.size, cuda.grid(1), cuda.gridsize(1)
    while i + 3 * s < n:
        g0, g1, g2, g3 = dout[i], dout[i + s], dout[i + 2 * s], dout[i + 3 * s]
        _put(d, i, g0, accumulate)
        _put(d, i + s, g1, accumulate)
        _put(d, i + 2 * s, g2, accumulate)
        _put(d, i + 3 * s, g3, accumulate)
        i += 4 * s
    while i < n:
        _put(d, i, dout[i], accumulate)
        i += s


@cuda.jit
def residual_backward_kernel(dout, da, db, accumulate):
    # both gradients in one pass: dout is read once, not twice
    n, i, s = dout.size, cuda.grid(1), cuda.gridsize(1)
    while i + 3 * s < n:
        g0, g1, g2, g3 = dout[i], dout[i + s], dout[i + 2 * s], dout[i + 3 * s]
        for d in (da, db):
            _put(d, i, g0, accumulate)
            _put(d, i + s, g1, accumulate)
            _put(d, i + 2 * s, g2, accumulate)
            _put(d, i + 3 * s, g3, accumulate)
        i += 4 * s
    while i < n:
        g = dout[i]
        _put(da, i, g, accumulate)
        _put(db, i, g, accumulate)
        i += s

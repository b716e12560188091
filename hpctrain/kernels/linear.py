"""Linear op: out = x @ w + b.  x (B, I), w (I, O), b (O,), out (B, O).

The weight is stored (I, O) so the forward GEMM reads it row-major; the three
products a Linear needs (x w, dout w^T, x^T dout) use transposed *views*, which
BLAS reads without copying.
"""

import numpy as np


# ---- CPU twin (NumPy/BLAS) ---------------------------------------------------------
def linear_forward(x, w, b, out):
    """out (B, O) <- x (B, I) @ w (I, O) + b (O,)."""
    np.matmul(x, w, out=out)
    out += b
    return out


def linear_backward(dout, x, w, dx, dw, db, accumulate=False):
    """Gradients of linear_forward given dout (B, O).

    dw (I, O) and db (O,) are views into the flat gradient buffer: overwritten,
    or added to when ``accumulate``. dx (B, I) is skipped when None (first layer).
    """
    if accumulate:
        dw += x.T @ dout
        db += dout.sum(axis=0)
    else:
        np.matmul(x.T, dout, out=dw)
        np.sum(dout, axis=0, out=db)
    if dx is not None:
        np.matmul(dout, w.T, out=dx)
    return dx

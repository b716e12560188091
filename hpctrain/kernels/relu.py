"""ReLU op: out = max(x, 0), elementwise over a C-contiguous array of any shape."""

from numba import njit

from . import flat_views


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True)
def _relu_forward(x, out):
    for i in range(x.size):
        v = x[i]
        out[i] = v if v > 0 else 0.0


@njit(cache=True)
def _relu_backward(dout, x, dx):
    for i in range(x.size):
        dx[i] = dout[i] if x[i] > 0 else 0.0


def relu_forward(x, out):
    """out <- max(x, 0); ``x`` is kept by the caller for backward."""
    _relu_forward(*flat_views(x, out))
    return out


def relu_backward(dout, x, dx):
    """dx <- dout where x > 0, else 0 (the subgradient at 0 is 0)."""
    _relu_backward(*flat_views(dout, x, dx))
    return dx

"""GELU op (tanh approximation, as GPT-2 and llm.c), elementwise.

gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),  k = sqrt(2/pi)
Arrays must be C-contiguous (they are flattened to views).
"""

import math

from numba import njit

from . import flat_views

_K = math.sqrt(2.0 / math.pi)


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True)
def _gelu_forward(x, out):
    for i in range(x.size):
        v = x[i]
        out[i] = 0.5 * v * (1.0 + math.tanh(_K * (v + 0.044715 * v * v * v)))


@njit(cache=True)
def _gelu_backward(dout, x, dx):
    for i in range(x.size):
        v = x[i]
        t = math.tanh(_K * (v + 0.044715 * v * v * v))
        dt = _K * (1.0 + 3.0 * 0.044715 * v * v)
        dx[i] = dout[i] * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * dt)


def gelu_forward(x, out):
    """out <- gelu(x); ``x`` is kept by the caller for backward."""
    _gelu_forward(*flat_views(x, out))
    return out


def gelu_backward(dout, x, dx):
    """dx <- dout * gelu'(x)."""
    _gelu_backward(*flat_views(dout, x, dx))
    return dx

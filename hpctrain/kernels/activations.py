"""Scalar activation functions and their derivatives, written once as plain
Python and compiled twice: ``numba.njit`` for the CPU twins and
``numba.cuda.jit(device=True)`` for the CUDA kernels, so both run the same math.

gelu is the tanh approximation (as GPT-2 and llm.c):
  gelu(v) = 0.5 v (1 + tanh(k (v + 0.044715 v^3))),  k = sqrt(2/pi)
relu's subgradient at 0 is 0.
"""

import math

from numba import cuda, njit

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


_PLAIN = {"identity": (_identity, _identity_grad), "relu": (_relu, _relu_grad), "gelu": (_gelu, _gelu_grad)}
NAMES = tuple(_PLAIN)

# name -> (f, f') compiled for each target
CPU = {name: (njit(f), njit(df)) for name, (f, df) in _PLAIN.items()}
CUDA = {name: (cuda.jit(device=True)(f), cuda.jit(device=True)(df)) for name, (f, df) in _PLAIN.items()}

"""Devices: who owns array memory, host<->device copies and the kernel table.

The rest of hpctrain never asks "am I on a GPU?": layers call ``device.ops.<op>``
and allocate through ``device.empty``/``device.zeros``. Adding the CUDA device
(issue 3) means one more class here with the same attributes, whose ``ops``
point at the ``numba.cuda`` launchers in :mod:`hpctrain.kernels`, plus a line
in :func:`make_device`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .kernels.adamw import adamw_step
from .kernels.gelu import gelu_backward, gelu_forward
from .kernels.linear import linear_backward, linear_forward
from .kernels.relu import relu_backward, relu_forward
from .kernels.sgd import sgd_step
from .kernels.softmax_xent import softmax_xent_backward, softmax_xent_forward


def _scale(buf, factor):
    """buf *= factor in place (the 1/world average after a sum all-reduce)."""
    buf *= buf.dtype.type(factor)
    return buf


CPU_OPS = SimpleNamespace(
    linear_forward=linear_forward, linear_backward=linear_backward,
    relu_forward=relu_forward, relu_backward=relu_backward,
    gelu_forward=gelu_forward, gelu_backward=gelu_backward,
    softmax_xent_forward=softmax_xent_forward, softmax_xent_backward=softmax_xent_backward,
    sgd_step=sgd_step, adamw_step=adamw_step, scale=_scale,
)


class CpuDevice:
    """NumPy arrays in host memory; GEMM through NumPy's BLAS, elementwise ops in numba."""

    name = "cpu"
    ops = CPU_OPS

    def __init__(self, dtype="float32"):
        self.dtype = np.dtype(dtype)

    def empty(self, shape, dtype=None):
        return np.empty(shape, dtype=dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype=dtype or self.dtype)

    def from_host(self, array, dtype=None):
        """A device array holding ``array`` (cast to the compute dtype unless ``dtype`` is given)."""
        return np.ascontiguousarray(array, dtype=dtype or self.dtype)

    def to_host(self, array):
        return np.asarray(array)

    def synchronize(self):
        """Nothing queued on the CPU; the CUDA device waits for its stream here."""

    def describe(self) -> str:
        return f"cpu ({self.dtype.name})"


def make_device(name: str, dtype: str, world=None):
    """The device a rank computes on. ``auto`` is the CPU until the CUDA device lands."""
    if name in ("cpu", "auto"):
        return CpuDevice(dtype)
    from .errors import ConfigError

    raise ConfigError(f"train.device={name!r}: this build supports 'auto' and 'cpu'")

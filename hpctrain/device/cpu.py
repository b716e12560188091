"""The CPU device: NumPy arrays in host memory, the kernels' CPU twins (:mod:`.ops`)."""

from __future__ import annotations

import numpy as np

from .ops import cpu_ops
from .transfers import HostFence

CPU_OPS = cpu_ops()   # one table shared by every CPU device (op_times wraps a device's own copy)


class CpuDevice:
    """NumPy arrays in host memory; GEMM through NumPy's BLAS, elementwise ops in numba."""

    name = "cpu"
    ops = CPU_OPS
    gemm_note = None  # NumPy's BLAS: nothing to warn about

    def __init__(self, dtype="float32"):
        self.dtype = np.dtype(dtype)
        self.accum_dtype = self.dtype   # what ops save in full precision (hpctrain.precision)

    def empty(self, shape, dtype=None):
        return np.empty(shape, dtype=dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype=dtype or self.dtype)

    def from_host(self, array, dtype=None):
        """A device array holding ``array`` (cast to the compute dtype unless ``dtype`` is given)."""
        return np.ascontiguousarray(array, dtype=dtype or self.dtype)

    def upload(self, array, slot, dtype=None):
        return self.from_host(array, dtype)  # host memory already: no copy unless a cast is needed

    def copy_from_host(self, dst, src):
        dst[...] = src

    def to_host(self, array):
        return np.asarray(array)

    def synchronize(self):
        """Nothing queued on the CPU."""

    def launches(self) -> None:
        """None: the CPU launches no kernels (a GPU's count goes in the metrics)."""
        return None

    fence = HostFence()

    def describe(self) -> str:
        return f"cpu ({self.dtype.name})"

"""``train.precision``: which dtype each kind of array has, and the device that computes in them.

A :class:`Precision` names, in one place, the dtypes of a run (:func:`policy`):

  master    the parameters the optimizer updates, their gradients, and checkpoints: train.dtype
  state     the optimizer's state: the master dtype
  reduce    gradients on the wire: the master dtype, or ``dist.reduce_dtype``'s 16-bit format
  compute   activations, their gradients and the parameters' compute copy: bf16 / fp16, or the
            master dtype for fp32
  accum     inside every op (GEMM sums, LayerNorm statistics, softmax, the loss): float32 under
            bf16 / fp16, the master dtype under fp32

With bf16 or fp16 the layers run on a :class:`~hpctrain.device.mixed.MixedDevice`: each op reads its
16-bit operands as float32 (exactly), runs the float32 kernel and rounds what it writes to nearest
even, at PyTorch autocast's rounding points; parameter gradients stay float32 and the compute copy
is the masters rounded at the start of every forward (docs/precision.md: where, and what it costs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError
from .kernels.lowp import FORMATS, UNIT_ROUNDOFF

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Precision:
    """The dtypes of a run (see the module docstring). ``name``: fp32, bf16 or fp16."""

    name: str
    master: np.dtype
    compute: np.dtype
    wire: str = "fp32"   # dist.reduce_dtype: fp32 (the master dtype), bf16 or fp16

    @property
    def state(self) -> np.dtype:
        return self.master

    @property
    def reduce(self) -> np.dtype:
        """The gradients' dtype on the wire: the master's, or ``dist.reduce_dtype``'s 16-bit format
        (bf16 as its uint16 bit patterns; the fp16 / bf16 compressor sends them)."""
        return self.master if self.wire == "fp32" else FORMATS[self.wire]

    @property
    def accum(self) -> np.dtype:
        return np.dtype(np.float32) if self.mixed else self.master

    @property
    def mixed(self) -> bool:
        """Whether the model computes in a 16-bit format (a :class:`MixedDevice`)."""
        return self.name != "fp32"

    @property
    def unit_roundoff(self) -> float:
        """The relative error of one rounding to the compute format (0 for fp32: none added)."""
        return UNIT_ROUNDOFF.get(self.name, 0.0)

    def describe(self) -> str:
        if not self.mixed:
            return f"parameters, compute and optimizer state in {self.master.name}"
        return (f"{self.name} compute (activations and the parameters' copy; float32 inside each op), "
                f"{self.master.name} master parameters, gradients and optimizer state")


def policy(precision: str, dtype: str = "float32", reduce_dtype: str = "fp32") -> Precision:
    """The :class:`Precision` of ``train.precision`` over ``train.dtype`` (the master dtype), with
    gradients on the wire in ``dist.reduce_dtype``."""
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    master = np.dtype(dtype)
    if precision == "fp32":
        return Precision("fp32", master, master, reduce_dtype)
    if master != np.float32:
        raise ConfigError(f"train.precision={precision!r} keeps float32 master parameters, but train.dtype = "
                          f"{master.name}; use train.dtype = 'float32' (float64 is for exactness checks, in fp32)")
    return Precision(precision, master, FORMATS[precision], reduce_dtype)

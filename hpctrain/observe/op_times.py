"""Per-op time of a step (``train.op_times``): where a model's forward and backward go.

The device's kernel table is wrapped so every call of a model or optimizer op adds its
wall-clock time to its family: gemm (the Linear layers and the tied LM head), attention
(its batched per-head GEMMs and fused softmax), layernorm, embedding, loss (softmax
cross-entropy), elementwise (bias + activation, residual adds) and optimizer. The metrics
get ``t_op_<family>`` per step. Ops of the communication thread (scale, NaN test,
compression) are not wrapped: they overlap the step and are in ``comm_time``. On a GPU each
call synchronises the stream, so the split is honest but the step slower: leave it off for
speed runs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from types import SimpleNamespace

FAMILIES = {"linear": "gemm", "tied_head": "gemm", "attention": "attention", "layernorm": "layernorm",
            "residual_layernorm": "layernorm",
            "embedding": "embedding", "softmax_xent": "loss", "softmax_xent_fused": "loss",  # ..._fused_add
            "bias_act": "elementwise", "residual": "elementwise",
            "sgd": "optimizer", "adamw": "optimizer", "lamb": "optimizer"}


def family_of(op: str) -> str | None:
    """'linear_forward' -> 'gemm'; None for ops that are not timed."""
    return FAMILIES.get(op.rsplit("_", 1)[0])  # the name without _forward, _backward or _step


class OpTimes:
    """Wraps ``device.ops`` in place (the device keeps the wrapped table); :meth:`pop` per step."""

    def __init__(self, *devices):
        """Wraps the kernel table of each of ``devices`` (the model's, when a 16-bit train.precision
        gives it a device of its own, so its ops are timed with their conversions)."""
        self.totals: dict[str, float] = defaultdict(float)
        for device in {id(d): d for d in devices}.values():
            sync = device.synchronize if device.name != "cpu" else None
            table = {}
            for name, fn in vars(device.ops).items():
                family = family_of(name)
                table[name] = fn if family is None or not callable(fn) else self._timed(fn, family, sync)
            device.ops = SimpleNamespace(**table)

    def _timed(self, fn, family, sync):
        totals = self.totals

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync is not None:
                sync()
            totals[family] += time.perf_counter() - t0
            return out
        return timed

    def pop(self) -> dict[str, float]:
        """``{"t_op_gemm": s, ...}`` since the last pop, and cleared."""
        out = {f"t_op_{k}": v for k, v in self.totals.items()}
        self.totals.clear()
        return out

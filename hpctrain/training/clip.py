"""Global gradient-norm clipping (``optim.clip_grad_norm``): the L2 norm of the averaged gradient
over every parameter of the model, whatever the layout, and the gradient scaled down to it.

As ``torch.nn.utils.clip_grad_norm_``: the gradient is multiplied by c / (norm + 1e-6) when that is
below 1 (c = clip_grad_norm), once every bucket is reduced and before the optimizer reads it. The
norm counts each element of the logical gradient once (:func:`counted_runs`): only data rank 0
counts a replicated gradient (under ZeRO every rank counts its own chunks); only tensor rank 0 a
parameter every tensor rank holds whole (LayerNorms, the embeddings), each rank its own pieces of a
split one; each pipeline stage its own blocks, the tied table on the first stage only. Each rank's
sum of squares is float64 in a fixed order (kernels/sum_squares.py); :meth:`GradClip.apply`
(collective over the world) gathers them and every rank adds them in rank order, so every replica
applies the same coefficient bit for bit and N ranks without ZeRO give the 1-rank norm's bits. A
non-finite norm leaves the gradient alone, and the step counts its gradient as non-finite for the
numerical guard.
"""

from __future__ import annotations

import math

EPS = 1e-6   # added to the norm before dividing, as PyTorch's clip_grad_norm_


def counted_runs(ranges, slots, split_names, sharded: bool, data_rank: int, tensor_rank: int, copies=()):
    """The flat [lo, hi) runs of ``ranges`` (this rank's update ranges) whose squares this rank adds
    to the norm (module doc): ``slots`` the flat parameters' slots, ``split_names`` the tensor-split
    parameters' names, ``sharded`` ZeRO (each rank owns its ranges), ``copies`` the names of
    parameters another stage counts (a pipeline's last stage: the tied table, counted on the first)."""
    if not sharded and data_rank != 0:
        return []
    runs = []
    for lo, hi in ranges:
        for slot in slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.size)
            if a < b and slot.name not in copies and (slot.name in split_names or tensor_rank == 0):
                if runs and runs[-1][1] == a:
                    runs[-1] = (runs[-1][0], b)
                else:
                    runs.append((a, b))
    return runs


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What the gradient is multiplied by: min(1, max_norm / (norm + EPS)); 1 for a non-finite norm
    (the numeric guard judges that step; scaling would only spread the NaN)."""
    if not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + EPS))


class GradClip:
    """Clips this rank's averaged gradient of the ranges it updates (``ranges``), once every bucket
    is reduced. ``grad_of(lo, hi)``: the device view of the averaged gradient of flat [lo, hi) (the
    optimizer's: ZeRO-2 keeps it packed). Collective over the world (:meth:`apply`)."""

    def __init__(self, plan, model, grad_of, ranges, max_norm: float):
        layout = getattr(model, "tensor_layout", None)
        self.device, self.world, self.grad_of, self.max_norm = plan.device, plan.world, grad_of, float(max_norm)
        self.ranges = list(ranges)
        self.runs = counted_runs(self.ranges, model.flat.slots, set(layout.splits) if layout else set(),
                                 plan.shards is not None, plan.dp.rank, plan.grid.tensor_rank,
                                 ("wte",) if plan.grid.stage > 0 else ())
        self.norm = self.coefficient = None   # the last step's (for the metrics)

    def apply(self) -> float:
        """The global norm of the averaged gradient; the gradient scaled when it exceeds the limit.
        Every rank gets the same bits: the ranks' sums are gathered and added in rank order."""
        local = self.device.ops.sum_squares([self.grad_of(lo, hi) for lo, hi in self.runs])
        total = 0.0
        for part in self.world.comm.allgather(local):
            total += part
        self.norm = math.sqrt(total) if total >= 0 else float("nan")
        self.coefficient = clip_coefficient(self.norm, self.max_norm)
        if self.coefficient < 1.0:
            for lo, hi in self.ranges:
                self.device.ops.scale(self.grad_of(lo, hi), self.coefficient)
        return self.norm

    def metrics(self) -> dict:
        """``grad_norm`` (before clipping) and ``grad_clip`` (the coefficient applied, 1: none)."""
        return {"grad_norm": self.norm, "grad_clip": self.coefficient}

"""The learning rate per step: the linear scaling rule's peak, warmup, then cosine, step or constant."""

from __future__ import annotations

import math


def peak_lr(cfg_optim, global_batch: int) -> float:
    """The configured lr, times global_batch / base_batch under the linear scaling rule."""
    if cfg_optim.scale_lr:
        return cfg_optim.lr * global_batch / cfg_optim.base_batch
    return cfg_optim.lr


class LRSchedule:
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then cosine, step or constant.

    ``lr(step)`` takes the 0-based index of the step about to run, so step 0
    of a warmup uses peak / warmup_steps (never exactly 0).
    """

    def __init__(self, cfg_optim, peak: float, total_steps: int):
        self.cfg, self.peak, self.total = cfg_optim, peak, max(1, total_steps)

    def lr(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup_steps:
            return self.peak * (step + 1) / c.warmup_steps
        if c.schedule == "constant":
            return self.peak
        if c.schedule == "step":
            return self.peak * c.gamma ** ((step - c.warmup_steps) // c.step_size)
        # cosine from peak (first step after warmup) to min_lr (last step, total - 1)
        span = max(1, self.total - 1 - c.warmup_steps)
        progress = min(1.0, (step - c.warmup_steps) / span)
        return c.min_lr + 0.5 * (self.peak - c.min_lr) * (1.0 + math.cos(math.pi * progress))

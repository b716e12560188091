"""Optimizers over the flat parameter buffer, and the learning-rate schedule.

Each optimizer owns flat state buffers of P elements (momentum; Adam moments)
and runs one device kernel per step, or one per gradient bucket: ``begin_step()``
then ``update(lr, lo, hi)`` for element ranges as their buckets are reduced
(the update is elementwise, so slices give the same result as the whole).
``step(lr)`` does both for the whole buffer. State is exposed by ``state()``
as named flat arrays so checkpoints can save and restore it.
"""

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


class SGD:
    """SGD with momentum, Nesterov and L2 weight decay (PyTorch semantics)."""

    def __init__(self, device, flat, cfg_optim):
        self.device, self.flat, self.cfg = device, flat, cfg_optim
        self.momentum_buf = device.zeros(flat.size)

    def begin_step(self):
        """Nothing per step for SGD."""

    def update(self, lr: float, lo: int = 0, hi: int | None = None):
        c, f = self.cfg, self.flat
        s = slice(lo, f.size if hi is None else hi)
        self.device.ops.sgd_step(f.data[s], f.grad[s], self.momentum_buf[s], lr,
                                 c.momentum, c.weight_decay, c.nesterov)

    def step(self, lr: float):
        self.begin_step()
        self.update(lr)

    def state(self) -> dict:
        return {"momentum": self.momentum_buf}


class AdamW:
    """Adam with decoupled weight decay (PyTorch semantics); ``t`` counts steps taken."""

    def __init__(self, device, flat, cfg_optim):
        self.device, self.flat, self.cfg = device, flat, cfg_optim
        self.exp_avg = device.zeros(flat.size)
        self.exp_avg_sq = device.zeros(flat.size)
        self.t = 0

    def begin_step(self):
        self.t += 1  # once per step, however many slices get updated

    def update(self, lr: float, lo: int = 0, hi: int | None = None):
        c, f = self.cfg, self.flat
        s = slice(lo, f.size if hi is None else hi)
        self.device.ops.adamw_step(f.data[s], f.grad[s], self.exp_avg[s], self.exp_avg_sq[s],
                                   self.t, lr, c.beta1, c.beta2, c.eps, c.weight_decay)

    def step(self, lr: float):
        self.begin_step()
        self.update(lr)

    def state(self) -> dict:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


def make_optimizer(device, flat, cfg_optim):
    return {"sgd": SGD, "adamw": AdamW}[cfg_optim.name](device, flat, cfg_optim)

"""Optimizers over the flat parameter buffer, and the learning-rate schedule.

Each optimizer owns flat state buffers of P elements (momentum; Adam moments)
and runs one device kernel per step, or one per gradient bucket: ``begin_step(step, lr)``
then ``update(lo, hi)`` for element ranges as their buckets are reduced
(the update is elementwise, so slices give the same result as the whole).
``step(lr)`` does both for the whole buffer. State is exposed by ``state()``
as named flat arrays so checkpoints can save and restore it.

What changes per step (the learning rate, Adam's step count and bias corrections) reaches the
kernels in device memory: ``begin_step`` computes the step's scalars on the host in float64 and
uploads them, rounded to the parameters' dtype, into one device array (:attr:`hyper`, a row per
decay: no decay, decay), and every ``update`` launch reads them there. So the launches of an
update are the same at every step, which lets a CUDA graph replay them (training/cuda_graphs.py);
``graph_key()`` names what would still change them.

Weight decay applies to the parameters the model does not list in
``no_decay`` (a GPT's biases and LayerNorm parameters): the flat buffer is
cut into runs of equal decay once, and an update over [lo, hi) runs the
kernel once per run it overlaps (a GPT lays each block's matrices out before
its vectors, so a block is two runs).
"""

from __future__ import annotations

import math

import numpy as np

from .kernels import adamw, sgd


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


def decay_runs(flat, no_decay) -> list[tuple[int, int, bool]]:
    """(lo, hi, decays) runs covering ``flat`` in order, adjacent slots of equal decay merged."""
    runs: list[list] = []
    for s in flat.slots:
        decays = s.name not in no_decay
        if runs and runs[-1][2] == decays:
            runs[-1][1] = s.offset + s.size
        else:
            runs.append([s.offset, s.offset + s.size, decays])
    return [tuple(r) for r in runs]


class _Optimizer:
    """The update split into runs of equal decay, shared by both optimizers: ``_kernel(s, hyper)`` runs
    the optimizer's kernel on the flat slice ``s`` with the scalars ``hyper`` (a row of :attr:`hyper`),
    ``_hyper(lr, weight_decay)`` makes such a row on the host.

    ``shards`` (a :class:`~hpctrain.comm.zero.ZeroShards`, ``dist.zero >= 1``): the state holds only this
    rank's chunks, packed (``state_size`` elements), and updates run only on ranges inside them.
    ``grads`` (``dist.zero = 2``): the averaged gradient of those chunks, packed alike, read instead of
    ``flat.grad``.
    """

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None):
        self.device, self.flat, self.cfg, self.shards, self.grads = device, flat, cfg_optim, shards, grads
        self.runs = decay_runs(flat, no_decay)
        self.state_size = flat.size if shards is None else shards.owned
        self.hyper = None  # the step's scalars on the device, (2, n): rows for no decay and decay

    def _state(self, s: slice) -> slice:
        """The state's slice for the flat slice ``s``."""
        return s if self.shards is None else self.shards.packed(s.start, s.stop)

    def _grad(self, s: slice):
        """The averaged gradient of the flat slice ``s``."""
        return self.flat.grad[s] if self.grads is None else self.grads[self._state(s)]

    def grad_of(self, lo: int, hi: int):
        """The averaged gradient the update of the flat range [lo, hi) reads (a device view)."""
        return self._grad(slice(lo, hi))

    def begin_step(self, step: int | None, lr: float):
        """Once per update, however many slices get updated: ``step`` is the global step (0-based),
        ``lr`` its learning rate. Uploads the step's scalars (:attr:`hyper`)."""
        self._advance(step)
        rows = [self._hyper(lr, weight_decay) for weight_decay in (0.0, self.cfg.weight_decay)]
        self.hyper = self.device.upload(np.stack(rows), "optimizer scalars")

    def _advance(self, step):
        """The optimizer's own per-step state, before the scalars are made (none for SGD)."""

    def graph_key(self) -> tuple:
        """What else the update's launches depend on this step (their arguments besides the arrays)."""
        return ()

    def state_of(self, lo: int, hi: int) -> dict:
        """The views of :meth:`state`'s arrays that the update of the flat range [lo, hi) writes."""
        s = self._state(slice(lo, hi))
        return {name: a[s] for name, a in self.state().items()}

    def update(self, lo: int = 0, hi: int | None = None):
        """The update of the flat range [lo, hi) (default: all), with :meth:`begin_step`'s scalars."""
        hi = self.flat.size if hi is None else hi
        for a, b, decays in self.runs:
            a, b = max(a, lo), min(b, hi)
            if a < b:
                self._kernel(slice(a, b), self.hyper[int(decays)])

    def step(self, lr: float, global_step: int | None = None):
        self.begin_step(global_step, lr)
        self.update()


class SGD(_Optimizer):
    """SGD with momentum, Nesterov and L2 weight decay (PyTorch semantics)."""

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None):
        super().__init__(device, flat, cfg_optim, no_decay, shards, grads)
        self.momentum_buf = device.zeros(self.state_size)

    def _hyper(self, lr, weight_decay):
        return sgd.hyperparameters(self.flat.data.dtype, lr, self.cfg.momentum, weight_decay)

    def _kernel(self, s, hyper):
        self.device.ops.sgd_update(self.flat.data[s], self._grad(s), self.momentum_buf[self._state(s)], hyper,
                                   self.cfg.nesterov)

    def state(self) -> dict:
        return {"momentum": self.momentum_buf}


class AdamW(_Optimizer):
    """Adam with decoupled weight decay (PyTorch semantics); ``t`` counts steps taken.

    ``optim.freeze_step`` F > 0: from global step F on (0-based, the step at which
    ``dist.compress_start_step`` = F starts compressing) the second moment is frozen, bias-corrected
    as after F updates. It is decided by the global step, not by ``t``, so that a step the guard
    skipped (no update, ``t`` unchanged) cannot shift the freeze against compression's start.

    ``velocity_from`` S > 0 (``dist.compress_momentum``, with S = F): from global step S on the
    gradients are the ranks' summed velocities and ``exp_avg`` only decays (kernels/adamw.py).
    """

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, velocity_from=0):
        super().__init__(device, flat, cfg_optim, no_decay, shards, grads)
        self.exp_avg = device.zeros(self.state_size)
        self.exp_avg_sq = device.zeros(self.state_size)
        self.t = 0
        self.frozen_at = 0
        self.velocity_from, self.velocity = velocity_from, False

    def _advance(self, step):
        self.t += 1
        f = self.cfg.freeze_step
        self.frozen_at = f if f and step is not None and step >= f else 0
        self.velocity = bool(self.velocity_from) and step is not None and step >= self.velocity_from

    def graph_key(self) -> tuple:
        return (self.velocity,)

    def _hyper(self, lr, weight_decay):
        c = self.cfg
        return adamw.hyperparameters(self.flat.data.dtype, self.t, lr, c.beta1, c.beta2, c.eps, weight_decay,
                                     self.frozen_at)

    def _kernel(self, s, hyper):
        st = self._state(s)
        self.device.ops.adamw_update(self.flat.data[s], self._grad(s), self.exp_avg[st], self.exp_avg_sq[st], hyper,
                                     self.velocity)

    def state(self) -> dict:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


def make_optimizer(device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, velocity_from=0):
    """The optimizer ``optim.name`` over ``flat``; parameters named in ``no_decay`` get no weight decay;
    with ``shards`` (ZeRO) it keeps state for this rank's chunks only, with ``grads`` (ZeRO-2) it reads
    their gradient from there; ``velocity_from`` (AdamW only): see :class:`AdamW`."""
    if cfg_optim.name == "sgd":
        if velocity_from:
            raise ValueError("velocity_from: SGD has no velocity mode (dist.compress_momentum needs adamw)")
        return SGD(device, flat, cfg_optim, no_decay, shards, grads)
    return AdamW(device, flat, cfg_optim, no_decay, shards, grads, velocity_from)

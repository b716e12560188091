"""SGD and AdamW: elementwise updates over the flat parameter buffer (LAMB and LARS, whose steps need
each parameter's norms first: :mod:`hpctrain.optim.layerwise`).

Each optimizer owns flat state buffers (momentum; Adam's moments) of P elements, or of this rank's
ZeRO chunks. ``begin_step(step, lr)`` once per step, then ``update(lo, hi)`` for element ranges as
their buckets are reduced (elementwise, so slices give the result of the whole); ``step(lr)`` does
both for the whole buffer; ``state()`` names the arrays checkpoints save.

The per-step scalars (learning rate, Adam's step count and bias corrections) are computed on the
host in float64 by ``begin_step`` and uploaded, rounded to the parameters' dtype, into one device
array (:attr:`hyper`, a row each for no decay and decay) that every ``update`` launch reads: the
launches are then the same every step, so a CUDA graph can replay them (training/cuda_graphs.py);
``graph_key()`` names what would still change them. Weight decay skips the model's ``no_decay``
parameters: :class:`~hpctrain.optim.flat.FlatOptimizer` cuts the buffer into runs of equal decay
once and runs the kernel once per run an update overlaps.
"""

from __future__ import annotations

from ..kernels import adamw, sgd
from .flat import FlatOptimizer


class SGD(FlatOptimizer):
    """SGD with momentum, Nesterov and L2 weight decay (PyTorch semantics)."""

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, params=None):
        super().__init__(device, flat, cfg_optim, no_decay, shards, grads, params)
        self.momentum_buf = device.zeros(self.state_size)

    def _hyper(self, lr, weight_decay):
        return sgd.hyperparameters(self.flat.dtype, lr, self.cfg.momentum, weight_decay)

    def _kernel(self, s, hyper):
        self.device.ops.sgd_update(self._param(s), self._grad(s), self.momentum_buf[self._state(s)], hyper,
                                   self.cfg.nesterov)

    def state(self) -> dict:
        return {"momentum": self.momentum_buf}


class AdamW(FlatOptimizer):
    """Adam with decoupled weight decay (PyTorch semantics); ``t`` counts steps taken.

    ``optim.freeze_step`` F > 0: from global step F on (0-based, the step at which
    ``dist.compress_start_step`` = F starts compressing) the second moment is frozen, bias-corrected
    as after F updates. It is decided by the global step, not by ``t``, so that a step the guard
    skipped (no update, ``t`` unchanged) cannot shift the freeze against compression's start.

    ``velocity_from`` S > 0 (``dist.compress_momentum``, with S = F): from global step S on the
    gradients are the ranks' summed velocities and ``exp_avg`` only decays (kernels/adamw.py).
    """

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, velocity_from=0,
                 params=None):
        super().__init__(device, flat, cfg_optim, no_decay, shards, grads, params)
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
        return adamw.hyperparameters(self.flat.dtype, self.t, lr, c.beta1, c.beta2, c.eps, weight_decay,
                                     self.frozen_at)

    def _kernel(self, s, hyper):
        st = self._state(s)
        self.device.ops.adamw_update(self._param(s), self._grad(s), self.exp_avg[st], self.exp_avg_sq[st], hyper,
                                     self.velocity)

    def state(self) -> dict:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

"""The large-batch optimizers LAMB and LARS: each parameter's step scaled by a trust ratio.

Per parameter w with gradient g (docs/optimizers.md has the papers and the choices):

    LARS  local = eta ||w|| / (||g|| + b ||w||);  v = m v + lr local (g + b w);  w = w - v
    LAMB  m, v as Adam's;  r = m^ / (sqrt(v^) + eps) + wd w;  w = w - lr (||w|| / ||r||) r

A ratio is 1 where it is undefined (a zero norm or denominator) and for the ``no_decay``
parameters, which are also not decayed. The norms are of whole parameters, so the update waits
until every bucket is averaged (and clipped): :meth:`prepare` sums each parameter's squares over
what this rank updates, has ``sum_norms`` add the parts other ranks hold (ZeRO's shares, a
tensor-parallel split's pieces; the caller's collective) and makes the scalars; :meth:`update` then
runs the existing kernels per parameter: LARS ``scale`` then ``sgd_update`` with lr = 1, LAMB
``lamb_direction`` (r, for its norm) then ``adamw_update`` with lr ||w|| / ||r||. The norms are read
on the host (one copy and one wait a step on a GPU), so these updates are not CUDA-graph captured.
"""

from __future__ import annotations

import math

import numpy as np

from ..kernels import adamw, lamb, sgd
from .flat import FlatOptimizer


class LayerWise(FlatOptimizer):
    """What LAMB and LARS share: the flat buffer's parameters, this rank's parts of each, their
    norms' partial sums, and an update that runs parameter by parameter."""

    whole_gradient = True   # the Step reduces (and clips) every bucket, then calls prepare, then update

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, params=None):
        super().__init__(device, flat, cfg_optim, no_decay, shards, grads, params)
        self.no_decay = no_decay
        self.slot_ranges = [(s.offset, s.offset + s.size) for s in self.flat.slots]
        self.excluded = np.array([s.name in self.no_decay for s in self.flat.slots])
        self.ratios = np.ones(len(self.slot_ranges))   # the last step's trust ratios (for the metrics)
        self._slot_hyper = None

    def prepare(self, sum_norms) -> None:
        raise NotImplementedError

    def step(self, lr: float, global_step: int | None = None):
        """One whole update on one rank (no shares to add up: ``sum_norms`` is the identity)."""
        self.begin_step(global_step, lr)
        self.prepare(lambda sums: sums)
        self.update()

    def owned(self) -> list[tuple[int, int]]:
        """The flat ranges this rank updates: everything, or its ZeRO chunks."""
        if self.shards is None:
            return [(0, self.flat.size)]
        return [(lo, hi) for lo, hi, *_ in self.shards.pieces]

    def _pieces(self, j):
        """This rank's [a, b) runs of parameter j (clipped to its owned ranges)."""
        lo, hi = self.slot_ranges[j]
        return [(max(a, lo), min(b, hi)) for a, b in self.owned() if max(a, lo) < min(b, hi)]

    def _partial_sums(self, second) -> np.ndarray:
        """(slots, 2): per parameter this rank's sums of squares of the weights and of ``second(a, b)``
        (on a GPU: every one of them read back at once, one wait)."""
        groups = []
        for j in range(len(self.slot_ranges)):
            pieces = self._pieces(j)
            groups += [[self._param(slice(a, b)) for a, b in pieces], [second(a, b) for a, b in pieces]]
        return np.array(self.device.ops.sum_squares_each(groups), np.float64).reshape(len(self.slot_ranges), 2)

    def update(self, lo: int = 0, hi: int | None = None):
        """The step of the flat range [lo, hi), parameter by parameter, with :meth:`prepare`'s scalars."""
        hi = self.flat.size if hi is None else hi
        for j, (a, b) in enumerate(self.slot_ranges):
            a, b = max(a, lo), min(b, hi)
            if a < b:
                self._slot_step(j, slice(a, b))


class LARS(LayerWise):
    """Momentum SGD with LARS's per-parameter learning rate (module docstring); state ``momentum``
    holds v, which includes the learning rate (the paper's form)."""

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, params=None):
        super().__init__(device, flat, cfg_optim, no_decay, shards, grads, params)
        self.momentum_buf = device.zeros(self.state_size)

    def begin_step(self, step, lr):
        self._lr = lr   # the scalars are per parameter: made in prepare

    def prepare(self, sum_norms) -> None:
        """Each parameter's trust ratio from the whole parameter's norms (collective through
        ``sum_norms``, see the module docstring), and its SGD scalars."""
        sums = sum_norms(self._partial_sums(lambda a, b: self._grad(slice(a, b))))
        c = self.cfg
        rows, self._scale = [], []
        for j, (w2, g2) in enumerate(sums):
            decay = 0.0 if self.excluded[j] else c.weight_decay
            w, g = math.sqrt(w2), math.sqrt(g2)
            denominator = g + decay * w
            ratio = c.trust_coefficient * w / denominator if w > 0 and denominator > 0 and not self.excluded[j] else 1.0
            self.ratios[j] = ratio
            step = self._lr * ratio   # folded into the gradient and the decay: v = m v + step (g + b w)
            self._scale.append(step)
            rows.append(sgd.hyperparameters(self.flat.dtype, 1.0, c.momentum, decay * step))
        self._slot_hyper = self.device.upload(np.stack(rows), "lars scalars")

    def _slot_step(self, j, s):
        g = self._grad(s)
        self.device.ops.scale(g, self._scale[j])
        self.device.ops.sgd_update(self._param(s), g, self.momentum_buf[self._state(s)], self._slot_hyper[j], False)

    def state(self) -> dict:
        return {"momentum": self.momentum_buf}


class LAMB(LayerWise):
    """Adam's direction with LAMB's per-parameter trust ratio (module docstring); ``t`` counts steps.
    Keeps one more state-sized array, the direction r of this rank's share (not saved: it is
    recomputed every step)."""

    work_arrays = 1   # the direction, beside the saved state (memory accounting)

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, params=None):
        super().__init__(device, flat, cfg_optim, no_decay, shards, grads, params)
        self.exp_avg = device.zeros(self.state_size)
        self.exp_avg_sq = device.zeros(self.state_size)
        self.direction = device.zeros(self.state_size)
        self.t = 0

    def begin_step(self, step, lr):
        self.t += 1
        self._lr = lr
        c, dtype = self.cfg, self.flat.dtype
        self._direction_hyper = self.device.upload(np.stack([
            lamb.hyperparameters(dtype, self.t, c.beta1, c.beta2, c.eps, decay) for decay in (0.0, c.weight_decay)]),
            "lamb direction scalars")

    def prepare(self, sum_norms) -> None:
        """r for this rank's share, each parameter's trust ratio ||w|| / ||r|| from the whole
        parameter's norms (collective through ``sum_norms``), and its AdamW scalars."""
        ops = self.device.ops
        for j in range(len(self.slot_ranges)):
            hyper = self._direction_hyper[0 if self.excluded[j] else 1]
            for a, b in self._pieces(j):
                s, st = slice(a, b), self._state(slice(a, b))
                ops.lamb_direction(self._param(s), self._grad(s), self.exp_avg[st], self.exp_avg_sq[st], hyper,
                                   self.direction[st])
        sums = sum_norms(self._partial_sums(lambda a, b: self.direction[self._state(slice(a, b))]))
        c, rows = self.cfg, []
        for j, (w2, r2) in enumerate(sums):
            decay = 0.0 if self.excluded[j] else c.weight_decay
            w, r = math.sqrt(w2), math.sqrt(r2)
            ratio = w / r if w > 0 and r > 0 and not self.excluded[j] else 1.0
            self.ratios[j] = ratio
            rows.append(adamw.hyperparameters(self.flat.dtype, self.t, self._lr * ratio, c.beta1, c.beta2, c.eps,
                                              decay))
        self._slot_hyper = self.device.upload(np.stack(rows), "lamb scalars")

    def _slot_step(self, j, s):
        st = self._state(s)
        self.device.ops.adamw_update(self._param(s), self._grad(s), self.exp_avg[st], self.exp_avg_sq[st],
                                     self._slot_hyper[j], False)

    def state(self) -> dict:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

"""The optimizer over the flat parameter buffer that SGD, AdamW, LAMB and LARS build on: the update
split into runs of equal weight decay, ZeRO's packed state and gradients, and the per-step scalars
uploaded once (:mod:`hpctrain.optim.elementwise` says why; :mod:`hpctrain.optim.layerwise` for LAMB and LARS)."""

from __future__ import annotations

import numpy as np


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


class FlatOptimizer:
    """The update split into runs of equal decay, shared by both optimizers: ``_kernel(s, hyper)`` runs
    the optimizer's kernel on the flat slice ``s`` with the scalars ``hyper`` (a row of :attr:`hyper`),
    ``_hyper(lr, weight_decay)`` makes such a row on the host.

    ``shards`` (a :class:`~hpctrain.comm.zero.ZeroShards`, ``dist.zero >= 1``): the state holds only this
    rank's chunks, packed (``state_size`` elements), and updates run only on ranges inside them.
    ``grads`` (``dist.zero >= 2``): the averaged gradient of those chunks, packed alike, read instead of
    ``flat.grad``. ``params`` (``dist.zero = 3``): the parameters of those chunks, packed alike, the
    masters updated instead of ``flat.data`` (which then holds gathered copies).
    """

    def __init__(self, device, flat, cfg_optim, no_decay=frozenset(), shards=None, grads=None, params=None):
        self.device, self.flat, self.cfg, self.shards, self.grads = device, flat, cfg_optim, shards, grads
        self.params = params
        self.runs = decay_runs(flat, no_decay)
        self.state_size = flat.size if shards is None else shards.owned
        self.hyper = None  # the step's scalars on the device, (2, n): rows for no decay and decay

    def _state(self, s: slice) -> slice:
        """The state's slice for the flat slice ``s``."""
        return s if self.shards is None else self.shards.packed(s.start, s.stop)

    def _param(self, s: slice):
        """The master parameters of the flat slice ``s`` (the updated ones)."""
        return self.flat.data[s] if self.params is None else self.params[self._state(s)]

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

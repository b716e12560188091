"""Numerical guard: what a step with a NaN/Inf loss or gradient (or a loss spike) does to the run.

:meth:`NumericGuard.verdict` judges a step from its global statistics only (the mean loss and the
counts of ranks that saw a non-finite loss or averaged gradient, all-reduced), so every rank takes
the same branch. Policies (``guard.nonfinite``):

  abort     exit 5 (:class:`~hpctrain.errors.TrainingDiverged`) before anything of the step is saved;
            the optimizer still follows the all-reduce bucket by bucket.
  skip      the update is dropped (parameters, optimizer and compression state as before the step;
            the batch is consumed and the step counts).
  rollback  the newest checkpoint this run saved or loaded is reloaded and the bad batch is stepped
            over on the replay (:attr:`skip_steps`); a run without one saves one before its first step.

skip and rollback decide before the update, so the update waits for every bucket (:attr:`deferred`).
More than ``guard.max_bad_steps`` bad steps in one run: every policy exits 5. Costs and measurements:
docs/reliability.md.
"""

from __future__ import annotations

import math
from collections import deque

from ..errors import EXIT_DIVERGED, TrainingDiverged


class NumericGuard:
    """Judges each step from the global loss and the ranks that saw a non-finite number."""

    def __init__(self, cfg_guard, log):
        self.cfg, self.log = cfg_guard, log
        self.policy = cfg_guard.nonfinite
        self.deferred = self.policy in ("skip", "rollback")  # the update waits for the verdict
        self.losses: deque = deque(maxlen=cfg_guard.spike_window)
        self.bad_steps = 0
        self.skip_steps: set[int] = set()   # batches rollback found bad: stepped over on the replay

    def verdict(self, step: int, loss: float, bad_loss_ranks: int = 0, bad_grad_ranks: int = 0) -> str | None:
        """Why global step ``step`` is bad, or None if its update may stand.

        ``loss`` is the global mean loss; ``bad_loss_ranks`` counts the ranks whose own
        loss held a NaN or Inf, ``bad_grad_ranks`` those that found one in the averaged
        gradient (in their share of it, where the all-reduce tests shares: any is bad).
        Accepted losses feed the spike statistics; bad ones never do.
        """
        if bad_loss_ranks or bad_grad_ranks or not math.isfinite(loss):
            what = [f"the loss on {int(bad_loss_ranks)} rank(s)"] if bad_loss_ranks else []
            what += ["the averaged gradient"] if bad_grad_ranks else []
            return f"NaN/Inf in {' and '.join(what) or 'the loss'} at step {step} (global loss {loss:.6g})"
        z = self.spike_z(loss)
        if z is not None and z > self.cfg.spike_zscore:
            mean, std = self._stats()
            return (f"loss spike at step {step}: {loss:.6g} is {z:.1f} standard deviations above the mean "
                    f"{mean:.6g} (std {std:.3g}) of the last {len(self.losses)} steps (guard.spike_zscore="
                    f"{self.cfg.spike_zscore:g})")
        self.losses.append(loss)
        return None

    def spike_z(self, loss: float) -> float | None:
        """z-score of ``loss`` against the window; None while it fills or with the spike guard off."""
        if not self.cfg.spike_zscore or len(self.losses) < self.losses.maxlen:
            return None
        mean, std = self._stats()
        # a flat window (std ~ 0) must not turn rounding noise into a spike
        return (loss - mean) / max(std, 1e-6 * abs(mean), 1e-12)

    def _stats(self) -> tuple[float, float]:
        n = len(self.losses)
        mean = sum(self.losses) / n
        return mean, math.sqrt(sum((x - mean) ** 2 for x in self.losses) / (n - 1))

    def bad_step(self, step: int, reason: str) -> str:
        """Count a bad step; return the action ("abort" raises instead). Every rank calls it alike."""
        self.bad_steps += 1
        if self.policy == "abort":
            raise _diverged(f"{reason}; guard.nonfinite=abort stops the run (nothing of this step was saved; "
                            f"resume from the last checkpoint with --resume auto, with a lower optim.lr, or set "
                            f"guard.nonfinite=skip or rollback)")
        if self.bad_steps > self.cfg.max_bad_steps:
            raise _diverged(f"{reason}; that is {self.bad_steps} bad steps in this run, more than "
                            f"guard.max_bad_steps={self.cfg.max_bad_steps}: the run diverges (lower optim.lr, "
                            f"check the data, or resume from an earlier checkpoint)")
        self.log.warn(f"guard: {reason}; {self.policy} ({self.bad_steps} of at most "
                      f"{self.cfg.max_bad_steps} bad steps)")
        if self.policy == "rollback":
            self.skip_steps.add(step)
        return self.policy


def _diverged(message: str) -> TrainingDiverged:
    err = TrainingDiverged(message)
    err.agreed = True  # every rank judged the same all-reduced numbers
    assert err.exit_code == EXIT_DIVERGED
    return err

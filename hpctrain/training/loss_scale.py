"""fp16's dynamic loss scale (``train.precision = "fp16"``).

fp16 keeps 5 exponent bits: activation gradients below 2^-24 flush to zero. The loss's gradient is
multiplied by a scale S before backward (so every activation gradient is S times larger, inside
fp16's range) and the float32 parameter gradients are divided by S again, folded into the
averaging scale 1 / (ranks x micro-batches). The rule is PyTorch's ``GradScaler``'s: when the
averaged gradient holds an Inf or NaN on any rank, the step is not applied and S halves; after
``window`` applied steps in a row, S doubles.

An overflow at S = :data:`MIN_SCALE` is not the scale's to fix: the step goes to the numeric
guard as any non-finite gradient does, so ``guard.nonfinite`` (skip, rollback, abort) keeps its
meaning. A non-finite loss always goes to the guard.
"""

from __future__ import annotations

MIN_SCALE = 1.0


class LossScaler:
    """The scale and its clean-step count; :meth:`judge` after each step's global verdict."""

    def __init__(self, init: float = 2.0 ** 16, window: int = 2000):
        if not init >= MIN_SCALE or window < 1:
            raise ValueError(f"a loss scale starts at >= {MIN_SCALE} (not {init}) and grows after >= 1 step "
                             f"(not {window})")
        self.scale, self.window, self.clean = float(init), int(window), 0
        self.overflows = 0   # steps skipped by the scale so far

    def judge(self, loss_finite: bool, grad_finite: bool) -> bool:
        """True when this step overflowed and the scale takes it: do not apply it (S halved).
        False otherwise: the step goes on to the guard; call :meth:`applied` if it is applied."""
        if loss_finite and not grad_finite and self.scale > MIN_SCALE:
            self.scale = max(MIN_SCALE, self.scale / 2)
            self.clean = 0
            self.overflows += 1
            return True
        return False

    def applied(self) -> None:
        """A step was applied: after ``window`` in a row, the scale doubles."""
        self.clean += 1
        if self.clean >= self.window:
            self.scale *= 2
            self.clean = 0

    def state(self) -> list:
        """[scale, clean steps, overflows] for the checkpoint."""
        return [self.scale, float(self.clean), float(self.overflows)]

    def load(self, row) -> None:
        self.scale, self.clean, self.overflows = float(row[0]), int(row[1]), int(row[2])

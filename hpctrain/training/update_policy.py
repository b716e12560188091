"""Whether a step's update applies: fp16's loss scale first, then the numeric guard.

The step consults one :class:`UpdatePolicy` once its statistics are summed over the world (the same
numbers on every rank, so every rank decides alike). :attr:`UpdatePolicy.waits` says whether the
update must wait for that verdict (the guard's skip and rollback, and fp16's loss scale, may drop
it) or may follow the all-reduce bucket by bucket (the guard's abort stops the run instead).
"""

from __future__ import annotations

APPLIED, SKIPPED, OVERFLOW, ROLLBACK = "applied", "skipped", "overflow", "rollback"


class UpdatePolicy:
    """``guard``: the run's :class:`~hpctrain.reliability.numeric_guard.NumericGuard`; ``scaler``:
    fp16's :class:`~hpctrain.training.loss_scale.LossScaler`, or None."""

    def __init__(self, guard, scaler=None):
        self.guard, self.scaler = guard, scaler

    @property
    def waits(self) -> bool:
        """Whether updates wait for :meth:`decide` (else they are applied as the buckets arrive)."""
        return self.guard.deferred or self.scaler is not None

    @property
    def loss_scale(self) -> float:
        """The scale the next step's loss gradient is multiplied by (1 without fp16)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def decide(self, step: int, loss: float, bad_loss_ranks: int, bad_grad_ranks: int) -> tuple[str, str | None]:
        """(outcome, the guard's reason or None) of global step ``step`` from its global mean
        ``loss`` and the ranks that saw a NaN or Inf in their loss or their share of the averaged
        gradient. Outcomes: :data:`APPLIED`; :data:`OVERFLOW`, dropped by the loss scale (halved);
        :data:`SKIPPED` or :data:`ROLLBACK` by the guard's policy. A guard set to abort raises
        :class:`~hpctrain.errors.TrainingDiverged` instead. Every rank calls it alike."""
        scaler = self.scaler
        if scaler is not None and scaler.judge(not bad_loss_ranks, not bad_grad_ranks):
            return OVERFLOW, None   # (fp16 runs without compression, whose residuals would need undoing)
        reason = self.guard.verdict(step, loss, bad_loss_ranks, bad_grad_ranks)
        if reason is None:
            if scaler is not None:
                scaler.applied()
            return APPLIED, None
        action = self.guard.bad_step(step, reason)   # abort raises
        return (ROLLBACK if action == "rollback" else SKIPPED), reason

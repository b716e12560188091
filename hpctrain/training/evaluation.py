"""Evaluation: the held-out loss and accuracy (bits per byte for byte tokens), and the run's targets.

Each rank scores its share of the evaluation set with a forward only (no gradient or optimizer
state touched), through the step (a pipeline passes each chunk along its stages); the sums are
all-reduced over the world. Collective.
"""

from __future__ import annotations

import math

import numpy as np


class Evaluation:
    """Scores ``data``'s evaluation set with ``step`` (its :meth:`~.step.Step.score`) as ``plan``
    lays the run out; ``watchdog`` watches its collectives; ``op_times``: the per-op timer whose
    evaluation share is dropped (it is no step's), or None."""

    def __init__(self, plan, data, step, watchdog, op_times=None):
        self.plan, self.data, self.stepper, self.watchdog, self.op_times = plan, data, step, watchdog, op_times

    def run(self, step: int, whole: bool = False) -> dict:
        """Loss, accuracy (and for byte tokens bpb) on the evaluation set: all of it with ``whole``,
        else the family's subset. ``step``: where the watchdog says it waits. Collective."""
        plan = self.plan
        totals = np.zeros(3)  # loss_sum, correct, predictions
        # a data group's tensor ranks score the same shard: each counts it once in the world's
        # sums below, loss and predictions alike, so the means are those of the data groups
        # (a pipeline's stages pass each chunk along; only the last stage's scores count)
        chunks = self.data.eval_shard(plan.dp.rank, plan.dp.size, whole)
        if plan.param_slots is None:
            for x_host, y_host in chunks:
                totals += self.stepper.score(x_host, y_host)
        else:   # ZeRO-3: a forward gathers over the data group, whose shards may hold unequal chunk
            while True:   # counts: every rank runs as many forwards (without a chunk, gathers only)
                chunk = next(chunks, None)
                with self.watchdog.watch("evaluation chunk count", f"step {step}", step, 10):
                    more = plan.dp.comm.allreduce(chunk is not None, op=_mpi().LOR)
                if not more:
                    break
                if chunk is None:
                    self.stepper.gather_only()
                else:
                    totals += self.stepper.score(*chunk)
        with self.watchdog.watch("evaluation all-reduce", f"step {step}", step, 10):
            plan.world.comm.Allreduce(_mpi().IN_PLACE, totals)
        if self.op_times:
            self.op_times.pop()  # evaluation's forward passes are not part of a training step's split
        if plan.tensor is not None:
            plan.tensor.take()   # nor its tensor all-reduces
        loss = float(totals[0] / totals[2])
        out = {"loss": loss, "accuracy": float(totals[1] / totals[2])}
        if self.data.bits_per_byte:
            out["bpb"] = loss / math.log(2)
        return out


def verdicts(train_cfg, data, scores: dict) -> tuple[bool, str]:
    """(whether every target of ``train_cfg`` was met, the final line to log) for the final
    evaluation ``scores``: train.target_accuracy, train.target_val_bpb, train.target_bpb_vs_bigram
    against the corpus's bigram baseline (``data.info``), which is said beside any target."""
    tc, met_all, said = train_cfg, True, []
    if tc.target_accuracy:
        met = scores["accuracy"] >= tc.target_accuracy
        said.append(f"target {100 * tc.target_accuracy:.1f}%: {'reached' if met else 'NOT reached'}")
        met_all &= met
    bigram = data.info.get("bigram_bpb")
    bpb_targets = [t for t in (tc.target_val_bpb, tc.target_bpb_vs_bigram * (bigram or 0)) if t]
    if bpb_targets:  # both set: the stricter one
        target = min(bpb_targets)
        met = scores.get("bpb", float("inf")) <= target
        said.append(f"target {target:.4f} bpb: {'reached' if met else 'NOT reached'}")
        met_all &= met
    if "bpb" in scores and bigram:  # the honest yardstick, beside any target
        said.append(f"the corpus's bigram baseline is {bigram:.4f} bpb: {scores['bpb'] / bigram:.3f}x of it")
    return met_all, f"final eval {describe_eval(scores)}" + (f" ({'; '.join(said)})" if said else "")


def describe_eval(scores: dict) -> str:
    """'accuracy 93.10%' for a classifier; 'loss 1.2345, 1.7810 bpb, accuracy 61.2%' for bytes."""
    if "bpb" in scores:
        return f"loss {scores['loss']:.4f}, {scores['bpb']:.4f} bpb, next-byte accuracy {100 * scores['accuracy']:.1f}%"
    return f"accuracy {100 * scores['accuracy']:.2f}%"


def _mpi():
    from mpi4py import MPI

    return MPI

"""How a step's micro-batches run: eagerly, replayed as CUDA graphs, or as a pipeline stage's schedule.

A runner does one step's forward and backward: this rank's rows in; out, the gradient (each
parameter handed to the reducer's ``mark_ready`` as backward finishes it) and the loss statistics,
added on the device into ``totals`` (loss_sum, correct). It also runs the optimizer's update of a
range (:meth:`EagerRunner.update`: replayed as a graph where graphs run) and an evaluation's
forward (:meth:`EagerRunner.score`). The :class:`~hpctrain.training.step.Step` reduces, judges and
updates alike whichever runner it holds (:func:`make_runner` picks one from the plan).
"""

from __future__ import annotations

import numpy as np

from ..data.sampler import shard_range
from .cuda_graphs import StepGraphs
from .pipeline import PipelineStage


class EagerRunner:
    """The k = ``train.grad_accum_steps`` micro-batches in turn, forward then backward, on the
    device's queue. ``fetch``: ZeRO-3's parameter gathers, or None."""

    def __init__(self, plan, model, timers, fetch=None):
        self.plan, self.model, self.timers, self.fetch = plan, model, timers, fetch

    def forward_backward(self, step: int, x_all, y_all, totals, reducer, loss_scale: float = 1.0) -> None:
        """The micro-batches of ``x_all``, ``y_all`` (host arrays: k equal parts, or parts differing by
        one row). Their gradients add up locally and only the last backward feeds the buckets (ZeRO-2:
        every backward, ``reducer.every_micro``: each reduced afresh)."""
        model, t, k = self.model, self.timers, self.plan.micro_batches
        for micro in range(k):
            x, y = self._upload(x_all, y_all, micro, k)
            fresh = micro == 0 or reducer.every_micro
            with t("forward"):   # the loss statistics stay on the device: no wait for the GPU here
                model.forward(x, y, totals=totals, accumulate=micro > 0, loss_scale=loss_scale, fetch=self.fetch)
            with t("backward"):
                model.backward(accumulate=not fresh, ready=reducer.mark_ready if micro == k - 1 or reducer.every_micro
                               else None, claim=reducer.claim, fetch=self.fetch)

    def _upload(self, x_all, y_all, micro: int, k: int):
        with self.timers("data"):
            part = slice(*shard_range(len(y_all), micro, k))
            device = self.plan.device
            return (device.upload(x_all[part], "x", self.model.input_dtype),
                    device.upload(y_all[part], "y", np.int64))

    def update(self, optimizer, lo: int, hi: int) -> None:
        """The optimizer's update of [lo, hi) (its step's scalars already set by ``begin_step``)."""
        optimizer.update(lo, hi)

    def update_waits(self, optimizer, ranges) -> bool:
        """Whether this step's updates of ``ranges`` must wait until every bucket is reduced (a
        graph capture records every launch on the stream, the communication thread's too)."""
        return False

    def score(self, x_host, y_host) -> tuple:
        """(loss_sum, correct, predictions) of evaluation rows ``x_host``, ``y_host``: a forward only."""
        device, model = self.plan.device, self.model
        x = device.upload(x_host, "eval_x", model.input_dtype)
        y = device.upload(y_host, "eval_y", np.int64)
        loss_sum, correct = model.forward(x, y, fetch=self.fetch)
        return loss_sum, correct, y_host.size

    def gather_only(self) -> None:
        """ZeRO-3: the parameter gathers of a forward without computing it (a rank with no evaluation
        chunk left, while the others of its data group score theirs). Collective over the data group."""
        for names in self.model.forward_groups:
            self.fetch(names, True)

    def metrics(self) -> dict:
        """This runner's figures of the last step for the metrics record (none)."""
        return {}


class GraphRunner(EagerRunner):
    """A micro-batch's forward and backward as one CUDA graph, and each range's update as another
    (:class:`~hpctrain.training.cuda_graphs.StepGraphs`). Backward's buckets are handed to the
    reducer once the replay is queued, in the order backward finished them when it ran eagerly."""

    def __init__(self, plan, model, timers, log=None):
        super().__init__(plan, model, timers)
        self.graphs = StepGraphs(plan.device, model, log)

    def forward_backward(self, step: int, x_all, y_all, totals, reducer, loss_scale: float = 1.0) -> None:
        """As :meth:`EagerRunner.forward_backward`; ``loss_scale`` is 1 (a 16-bit precision, and so
        fp16's loss scale, keeps the steps eager: :func:`~.cuda_graphs.why_not`)."""
        k, t = self.plan.micro_batches, self.timers
        for micro in range(k):
            x, y = self._upload(x_all, y_all, micro, k)
            with t("forward"):   # forward and backward in one graph (a replay, once captured)
                self.graphs.run(x, y, totals, micro > 0, not (micro == 0 or reducer.every_micro))
        with t("backward"):
            for name in self.graphs.ready_order:
                reducer.mark_ready(name)

    def update(self, optimizer, lo: int, hi: int) -> None:
        self.graphs.update(optimizer, lo, hi)   # the same launches every step: replayed as a graph per range

    def update_waits(self, optimizer, ranges) -> bool:
        """Under ZeRO-1 always (each update ends in a parameter all-gather, and whether a key is
        captured or checked may differ between ranks, a capture that failed on one GPU: the
        all-gathers must come in one order against the reductions on every rank); else while a
        range's update graph is captured or checked."""
        if self.plan.shards is not None:
            return True
        return any(self.graphs.settling(self.graphs.update_key(optimizer, lo, hi)) for lo, hi in ranges)


class PipelineRunner(EagerRunner):
    """This rank's pipeline stage runs the schedule's micro-batches (:class:`~.pipeline.PipelineStage`);
    its evaluation forward passes each chunk along the stages."""

    def __init__(self, plan, model, timers, watchdog, fetch=None):
        super().__init__(plan, model, timers, fetch)
        self.stage = PipelineStage(plan, model, timers, watchdog, fetch)

    def forward_backward(self, step: int, x_all, y_all, totals, reducer, loss_scale: float = 1.0) -> None:
        self.stage.run(step, x_all, y_all, totals, reducer.mark_ready, reducer.claim, reducer.every_micro,
                       loss_scale)

    def score(self, x_host, y_host) -> tuple:
        """Counted on the last stage (the others' predictions are 0)."""
        loss_sum, correct = self.stage.score(x_host, y_host)
        return loss_sum, correct, y_host.size if self.plan.grid.last_stage else 0

    def sum_tied(self, grad, step: int) -> None:
        """The tied table's gradient summed between the first and last stage
        (:meth:`~.pipeline.PipelineStage.sum_tied`). Collective over the embedding group."""
        self.stage.sum_tied(grad, step)

    def metrics(self) -> dict:
        """The last step's pipeline figures (:meth:`~.pipeline.PipelineStage.metrics`). Collective over
        the pipeline group."""
        return self.stage.metrics()


def make_runner(plan, model, timers, watchdog, graphs_off: str, fetch=None, log=None):
    """The runner ``plan`` calls for: a pipeline stage's, graphs where ``graphs_off`` is "" (see
    :func:`~hpctrain.training.cuda_graphs.why_not`), else eager."""
    if plan.pipeline > 1:
        return PipelineRunner(plan, model, timers, watchdog, fetch)
    if not graphs_off:
        return GraphRunner(plan, model, timers, log)
    return EagerRunner(plan, model, timers, fetch)

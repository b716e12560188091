"""One optimizer step: the batch in, the statistics out.

On every rank: this rank's rows of the global batch (read by the caller) -> k micro-batches of
forward and backward into the flat gradient -> the gradient averaged over the data group, bucket
by bucket, by the communication thread -> the optimizer update of each bucket as it arrives.
Because every rank starts from rank 0's parameters and applies the same averaged gradient, N ranks
with batch b train like one rank with batch N*b (up to floating-point summation order).

:class:`Step` is where a CUDA-graph replay or a pipeline schedule (:mod:`.pipeline`) replaces the eager sequence:
it needs only the plan, the training state, the learning-rate schedule, the timers and the
watchdog, and it returns :class:`StepStats`. It does not advance ``state.step``: the run loop
does, after judging the statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..comm.zero import traffic_halves
from ..comm.zero_grads import make_reducer
from ..data.sampler import shard_range
from .clip import GradClip
from .cuda_graphs import StepGraphs, why_not
from .pipeline import PipelineStage


@dataclass
class StepStats:
    """This rank's share of one step: the loss summed over its predictions, the correct ones, and
    whether its loss or (its share of) the averaged gradient held a NaN or Inf."""

    loss_sum: float
    correct: int
    loss_nonfinite: bool
    grad_nonfinite: bool


class _Unwatched:
    """A watchdog that watches nothing (a step used without the run's watchdog: unit tests)."""

    def watch(self, *args, **kwargs):
        import contextlib

        return contextlib.nullcontext()


class Step:
    """One optimizer step of ``state`` (model, optimizer, compression) as ``plan`` lays it out.

    ``schedule``: the learning rate per step; ``timers``: a :class:`~hpctrain.observe.log.Timers`
    (data, forward, backward, allreduce, optimizer, allgather); ``watchdog``: the run's stall
    watchdog (None: unwatched). Builds the gradient reducer (the communication thread) over the
    plan's buckets; collective calls happen only inside :meth:`run` and :meth:`apply_update`.
    """

    def __init__(self, plan, state, schedule, timers, watchdog=None, log=None):
        cfg = plan.cfg
        self.plan, self.state, self.schedule, self.timers = plan, state, schedule, timers
        self.watchdog = watchdog or _Unwatched()
        self.reducer = make_reducer(plan.allreduce, state.model.flat.grad, plan.buckets, plan.device, plan.shards,
                                    plan.grad_slots, plan.micro_batches, overlap=cfg.dist.overlap,
                                    compression=state.compression,
                                    # fp16's loss scale needs to see every overflow
                                    check_finite=cfg.guard.check_grads or state.loss_scale is not None)
        self._bucket_names = plan.bucket_names()
        # [loss_sum, correct] of a step, summed on the device over its micro-batches and read once
        self._totals = plan.device.zeros((2,), np.float64)
        # train.cuda_graphs: forward and backward replayed as graphs, or "" and why not
        self.graphs_off = why_not(cfg, plan.device, plan)
        self.graphs = None if self.graphs_off else StepGraphs(plan.device, state.model, log)
        # dist.zero = 3: each layer's parameters gathered before it runs (the model calls fetch)
        self.params = plan.param_slots
        if self.params is not None:
            self.params.watchdog = self.watchdog
            state.model.fetch = self.params.fetch
        # dist.pipeline_parallel: this rank's stage runs the schedule's micro-batches
        self.pipe = None if plan.pipeline == 1 else PipelineStage(plan, state.model, timers, self.watchdog)
        # the tied table's bucket on a pipeline's first and last stage: summed over the embedding group
        self._tied = next((b.index for b in plan.buckets if b.slots == ("wte",)), None) \
            if plan.grid.embedding is not None else None
        # optim.clip_grad_norm: the global norm once every bucket is reduced, before any update
        self.clip = None if not cfg.optim.clip_grad_norm else GradClip(
            plan, state.model, lambda lo, hi: self.state.optimizer.grad_of(lo, hi),
            [self._range(b) for b in plan.buckets], cfg.optim.clip_grad_norm)

    def run(self, step: int, x_all, y_all, update: bool = True) -> StepStats:
        """Forward, backward and all-reduce of global step ``step`` on this rank's rows ``x_all``,
        ``y_all`` (host arrays), and with ``update`` the optimizer step too (without it, the
        run loop calls :meth:`apply_update` once the step is judged). Collective over the plan's groups.

        With k = train.grad_accum_steps, the rows are k micro-batches whose gradients add up
        locally; only the last backward feeds the buckets (ZeRO-2: every backward,
        hpctrain.comm.zero_grads), and the sum over ranks and micro-batches is scaled once by
        1 / (size k). Where shares differ, each loss is weighted so that the result is still the
        mean over the whole global batch (the trainer sets the loss's row weight).
        """
        plan, model, t, wd = self.plan, self.state.model, self.timers, self.watchdog
        k, device, reducer = plan.micro_batches, plan.device, self.reducer
        scaler = self.state.loss_scale   # fp16: the loss's gradient times S, the average divided by S
        loss_scale = 1.0 if scaler is None else scaler.scale
        model.loss.loss_scale = loss_scale
        reducer.start(scale=1.0 / (plan.dp.size * k * loss_scale), step=step)
        if self.params is not None:
            self.params.begin_step()
        totals, graphs = self._totals, self.graphs
        if self.pipe is not None:
            self.pipe.run(step, x_all, y_all, totals, reducer.mark_ready, reducer.claim, reducer.every_micro)
        for micro in range(k if self.pipe is None else 0):
            last = micro == k - 1
            with t("data"):
                part = slice(*shard_range(len(y_all), micro, k))  # k equal parts, or differing by one row
                x = device.upload(x_all[part], "x", model.input_dtype)
                y = device.upload(y_all[part], "y", np.int64)
            fresh = micro == 0 or reducer.every_micro  # ZeRO-2 reduces every micro-batch: it overwrites
            if graphs is not None:  # forward and backward in one graph (a replay, once captured)
                with t("forward"):
                    graphs.run(x, y, totals, micro > 0, not fresh)
                continue
            with t("forward"):  # the loss statistics stay on the device: no wait for the GPU here
                model.forward(x, y, totals=totals, accumulate=micro > 0)
            with t("backward"):
                model.backward(accumulate=not fresh, ready=reducer.mark_ready if last or reducer.every_micro
                               else None, claim=reducer.claim)
        if graphs is not None:
            with t("backward"):  # the buckets, in backward's order, once the replay is queued
                for name in graphs.ready_order:
                    reducer.mark_ready(name)
        # the optimizer waits for each bucket in turn and updates just its slice
        # ("allreduce" is the exposed wait; the overlapped part hides in backward)
        if update:
            self.state.optimizer.begin_step(step, self.schedule.lr(step))
        # a step that captures or checks an update graph first waits for every bucket: a capture
        # records every launch on the stream, the communication thread's too
        # (and clipping needs the whole gradient's norm before any update, LAMB and LARS each parameter's)
        whole = getattr(self.state.optimizer, "whole_gradient", False)
        later = self.clip is not None or whole or update and graphs is not None and any(
            graphs.settling(graphs.update_key(self.state.optimizer, *self._range(b))) for b in plan.buckets)
        behind = None   # an offloaded optimizer's: the bucket whose update waits for the next one's copy
        for bucket, name in zip(plan.buckets, self._bucket_names):
            with t("allreduce"), wd.watch("gradient all-reduce", f"{name}, step {step}", step):
                reducer.wait(bucket)
            if bucket.index == self._tied:
                self._sum_tied(step, bucket)
            if update and not later:
                behind = self._update_next(step, bucket, name, behind)
        if behind is not None:
            self._update(step, *behind)
        if self.clip is not None:   # before the update, deferred or not: the gradient is clipped once
            with t("optimizer"), wd.watch("gradient norm all-reduce", f"step {step}", step):
                self.clip.apply()
        if update and later:
            self._prepare(step)
            self._update_all(step)
        if self.params is not None:
            self.params.end_step()
        loss_sum, correct = device.to_host(totals)   # the step's one read of its statistics
        grad_nonfinite = reducer.nonfinite or (self.clip is not None and not math.isfinite(self.clip.norm))
        return StepStats(float(loss_sum), int(correct), not math.isfinite(loss_sum), grad_nonfinite)

    def apply_update(self, step: int) -> None:
        """The optimizer step of judged step ``step`` whose buckets are all reduced (the numeric
        guard's deferred policies)."""
        self.state.optimizer.begin_step(step, self.schedule.lr(step))
        self._prepare(step)
        self._update_all(step)

    def _update_all(self, step) -> None:
        """The optimizer on every bucket, all reduced (and clipped), in order."""
        behind = None
        for bucket, name in zip(self.plan.buckets, self._bucket_names):
            behind = self._update_next(step, bucket, name, behind)
        if behind is not None:
            self._update(step, *behind)

    def _update_next(self, step, bucket, name, behind):
        """The update of ``bucket`` (reduced), now; or, with an offloaded optimizer (``fetch_gradient``), its
        gradient's copy to the host queued and the update of the bucket ``behind`` it run while the
        copy goes. Returns the bucket left behind (its (bucket, name)), or None."""
        fetch = getattr(self.state.optimizer, "fetch_gradient", None)
        if fetch is None:
            self._update(step, bucket, name)
            return None
        with self.timers("optimizer"):
            fetch(*self._range(bucket))
        if behind is not None:
            self._update(step, *behind)
        return bucket, name

    def _prepare(self, step) -> None:
        """LAMB and LARS: each parameter's trust ratio, from its norms over every rank that holds a
        part of it (hpctrain/optim/layerwise.py); nothing for the other optimizers."""
        optimizer = self.state.optimizer
        if getattr(optimizer, "whole_gradient", False):
            with self.timers("optimizer"), self.watchdog.watch("trust-ratio norms all-gather", f"step {step}", step):
                optimizer.prepare(self._sum_norms)

    def _sum_norms(self, partial):
        """Each parameter's sums of squares (``partial``: rows per flat slot, this rank's parts) over
        the ranks holding its other parts: ZeRO's data group, and for a tensor-parallel split its
        tensor group. Gathered and added in rank order, so every rank gets the same bits (as
        clipping's norm). Collective over those groups."""
        plan = self.plan
        if plan.shards is not None:
            partial = _ordered_sum(plan.dp.comm.allgather(partial))
        layout = getattr(self.state.model, "tensor_layout", None)
        if layout is not None:
            split = np.array([s.name in layout.splits for s in self.state.model.flat.slots])
            total = _ordered_sum(plan.grid.tensor.comm.allgather(partial))
            partial = np.where(split[:, None], total, partial)
        return partial

    def _update(self, step, bucket, name) -> None:
        """The optimizer on ``bucket`` (ZeRO-1 and 2: on this rank's chunk, then the bucket's parameters
        all-gathered, while the communication thread reduce-scatters the next buckets; ZeRO-3: on this
        rank's chunk, gathered when a layer next needs it)."""
        plan, optimizer = self.plan, self.state.optimizer
        lo, hi = self._range(bucket)
        with self.timers("optimizer"):
            if self.params is not None:   # ZeRO-3: the bucket's gathered copy is stale from here on
                self.params.stale(bucket.index)
            if self.graphs is None:
                optimizer.update(lo, hi)
            else:   # the same launches every step: replayed as a graph per range
                self.graphs.update(optimizer, lo, hi)
        if plan.shards is None or self.params is not None:   # (ZeRO-3 gathers before the next use)
            return
        with self.timers("allgather"), self.watchdog.watch("parameter all-gather", f"{name}, step {step}", step):
            plan.param_gather.allgather(self.state.model.flat.data[bucket.lo:bucket.hi])

    def _sum_tied(self, step, bucket) -> None:
        """A pipeline's tied table: the first stage's gradient (from the embedding) and the last's
        (from the head), each averaged over its data group, summed between the two stages. The
        sum of two is the same bits on both, so their copies of the table stay equal."""
        from mpi4py import MPI

        grad = self.state.optimizer.grad_of(*self._range(bucket))
        with self.timers("allreduce"), self.watchdog.watch("embedding-group all-reduce", f"wte, step {step}", step):
            with self.plan.staging.mpi_view(grad, "tied") as view:
                self.plan.grid.embedding.comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
        self.pipe.bytes_sent += grad.nbytes   # to the other end of the embedding group

    def score(self, x_host, y_host) -> tuple:
        """(loss_sum, correct, predictions) of evaluation rows ``x_host``, ``y_host`` on this rank: a
        forward only; under pipeline parallelism through every stage, counted on the last."""
        if self.pipe is not None:
            loss_sum, correct = self.pipe.score(x_host, y_host)
            return loss_sum, correct, y_host.size if self.plan.grid.last_stage else 0
        plan, model = self.plan, self.state.model
        x = plan.device.upload(x_host, "eval_x", model.input_dtype)
        y = plan.device.upload(y_host, "eval_y", np.int64)
        loss_sum, correct = model.forward(x, y)
        return loss_sum, correct, y_host.size

    def gather_only(self) -> None:
        """ZeRO-3: the parameter gathers of a forward without computing it (a rank with no evaluation
        chunk left, while the others of its data group score theirs). Collective over the data group."""
        for names in self.state.model.forward_groups:
            self.params.fetch(names, True)

    def _range(self, bucket) -> tuple[int, int]:
        """The flat range the optimizer updates for ``bucket`` (ZeRO: this rank's chunk of it)."""
        return (bucket.lo, bucket.hi) if self.plan.shards is None else self.plan.shards.pieces[bucket.index][:2]

    def clip_metrics(self) -> dict:
        """The last step's gradient norm and clip coefficient (optim.clip_grad_norm), or nothing."""
        return {} if self.clip is None else self.clip.metrics()

    def pipeline_metrics(self) -> dict:
        """The last step's pipeline figures (:meth:`.pipeline.PipelineStage.metrics`; collective over
        the pipeline group), or nothing without one."""
        return {} if self.pipe is None else self.pipe.metrics()

    def comm_metrics(self) -> dict:
        """The last step's communication for the metrics: times, bytes reduced and, per rank, bytes
        sent against the dense all-reduce's (2 (p-1)/p of the buckets), with the compressor's figures."""
        cfg, reducer, c = self.plan.cfg, self.reducer, self.state.compression
        out = {"comm_time": reducer.comm_s, "exposed_comm_time": reducer.exposed_s, "bytes_reduced": reducer.bytes,
               "allreduce": cfg.dist.allreduce}
        if c is None:
            p = self.plan.dp.size
            halves = traffic_halves(cfg.dist.zero, getattr(self.plan.allreduce, "native_halves", False),
                                    cfg.train.grad_accum_steps)
            dense = halves * (p - 1) * reducer.bytes // p
            if self.params is not None:   # ZeRO-3: the all-gathers before use, counted as they ran
                gathers, nbytes, exposed = self.params.last_step
                dense += (p - 1) * nbytes // p
                out.update(param_gathers=gathers, param_gather_bytes=nbytes, exposed_gather_time=exposed)
            return {**out, "bytes_sent": dense, "bytes_dense": dense}
        return {**out, "compress": cfg.dist.compress, "compress_scope": cfg.dist.compress_scope,
                "bytes_sent": c.sent_bytes, "bytes_dense": c.dense_bytes, "compression_ratio": c.ratio,
                "encode_time": c.encode_s, "decode_time": c.decode_s}


def _ordered_sum(parts):
    """The arrays ``parts`` added in list order (rank order: the same bits on every rank)."""
    total = np.zeros_like(parts[0])
    for part in parts:
        total = total + part
    return total

"""One optimizer step: the batch in, a :class:`StepResult` out.

On every rank: this rank's rows of the global batch -> the runner's forward and backward
(:mod:`.runners`: eager, CUDA graphs or a pipeline stage) into the flat gradient -> the gradient
averaged over the data group, bucket by bucket, by the communication thread -> clipping -> the
step's statistics summed over the world in one small all-reduce -> the update policy's verdict
(:mod:`.update_policy`). Where nothing can drop the update it runs before the all-reduce, bucket by
bucket as each is reduced (or once all are, for clipping, LAMB's and LARS's norms, or a graph
capture); where the policy may drop it, after the verdict. Either way through one path, and in the
same place relative to the all-reduce on every rank.
Because every rank starts from rank 0's parameters and applies the same averaged gradient, N ranks
with batch b train like one rank with batch N*b (up to floating-point summation order).

The step does not advance ``state.step``: the run loop does, after reading the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..comm.zero import traffic_halves
from ..comm.zero_grads import make_reducer
from .clip import GradClip
from .cuda_graphs import why_not
from .runners import make_runner
from .update_policy import APPLIED, OVERFLOW, SKIPPED


@dataclass
class StepResult:
    """What one step did, for the run loop's verdicts and the metrics record. The sums are over the
    world's whole batch (each prediction counted once), the same on every rank."""

    step: int                  # the global step (0-based) this was
    outcome: str               # applied, skipped (the guard), overflow (fp16's loss scale) or rollback
    reason: str | None         # the guard's reason for a bad step
    loss_sum: float            # the loss summed over the global batch's predictions
    correct: float             # predictions that were right (a classifier's accuracy)
    predictions: float         # the global batch's predictions
    bad_loss_ranks: int        # ranks whose loss held a NaN or Inf
    bad_grad_ranks: int        # ranks that found one in (their share of) the averaged gradient
    votes: tuple               # the caller's votes (:meth:`Step.run`), summed over the world
    lr: float                  # the learning rate of this step
    loss_scale: float | None   # fp16: the scale this step's gradient was computed with
    clip: dict = field(default_factory=dict)       # grad_norm and clip_coef (optim.clip_grad_norm)
    comm: dict = field(default_factory=dict)       # times and bytes of the gradient's reduction
    pipeline: dict = field(default_factory=dict)   # every stage's busy and idle time, bytes held and sent
    tensor: dict = field(default_factory=dict)     # the tensor group's all-reduces
    phases: dict = field(default_factory=dict)     # seconds per phase since the last step ended
    op_times: dict = field(default_factory=dict)   # train.op_times: seconds per op family
    launches: int | None = None                    # a GPU's host-side launches of the step (not a save's)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.predictions

    @property
    def accuracy(self) -> float:
        return self.correct / self.predictions

    @property
    def applied(self) -> bool:
        return self.outcome == APPLIED

    def metrics(self) -> dict:
        """The step's fields of a metrics record (hpctrain.observe.log.Metrics)."""
        out = {"loss": self.loss, "accuracy": self.accuracy, "lr": self.lr, **self.comm, **self.clip,
               **self.pipeline, **self.tensor, "skipped": not self.applied}
        if self.loss_scale is not None:
            out.update(loss_scale=self.loss_scale, overflow=self.outcome == OVERFLOW)
        return {**out, **{f"t_{k}": v for k, v in self.phases.items()}, **self.op_times,
                **({} if self.launches is None else {"launches": self.launches})}


class _Unwatched:
    """A watchdog that watches nothing (a step used without the run's watchdog: unit tests)."""

    def watch(self, *args, **kwargs):
        import contextlib

        return contextlib.nullcontext()


class Step:
    """One optimizer step of ``state`` (model, optimizer, compression) as ``plan`` lays it out.

    ``schedule``: the learning rate per step; ``policy``: the
    :class:`~hpctrain.training.update_policy.UpdatePolicy` that says whether an update applies;
    ``timers``: a :class:`~hpctrain.observe.log.Timers` (popped at the end of every step);
    ``watchdog``: the run's stall watchdog (None: unwatched); ``log``: where a failed CUDA graph
    capture is said; ``tracer``, ``ranges``: spans and NVTX ranges of the communication thread, or
    None; ``op_times``: an :class:`~hpctrain.observe.op_times.OpTimes`, popped every step, or None.
    Builds the gradient reducer (the communication thread) over the plan's buckets and the runner
    (collective over the pipeline group under pipeline parallelism: its communicator's duplicate);
    the other collective calls happen inside :meth:`run` and an evaluation's :meth:`score`.
    """

    def __init__(self, plan, state, schedule, policy, timers, watchdog=None, log=None, tracer=None, ranges=None,
                 op_times=None):
        cfg = plan.cfg
        self.plan, self.state, self.schedule, self.policy, self.timers = plan, state, schedule, policy, timers
        self.watchdog, self.op_times = watchdog or _Unwatched(), op_times
        self.reducer = make_reducer(plan.allreduce, state.model.flat.grad, plan.buckets, plan.device, plan.shards,
                                    plan.grad_slots, plan.micro_batches, overlap=cfg.dist.overlap,
                                    compression=state.compression,
                                    # fp16's loss scale needs to see every overflow
                                    check_finite=cfg.guard.check_grads or policy.scaler is not None,
                                    tracer=tracer, ranges=ranges,
                                    trace_args={"strategy": cfg.dist.allreduce, "compress": cfg.dist.compress})
        self._bucket_names = plan.bucket_names()
        self._update_ranges = [self._range(b) for b in plan.buckets]
        # [loss_sum, correct] of a step, summed on the device over its micro-batches and read once
        self._totals = plan.device.zeros((2,), np.float64)
        # dist.zero = 3: each layer's parameters gathered before it runs
        self.params = plan.param_slots
        fetch = None if self.params is None else self.params.fetch
        # train.cuda_graphs: "" where forward and backward replay as graphs, else why not
        self.graphs_off = why_not(cfg, plan.device, plan)
        self.runner = make_runner(plan, state.model, timers, self.watchdog, self.graphs_off, fetch, log)
        # the tied table's bucket on a pipeline's first and last stage: summed over the embedding group
        self._tied = next((b.index for b in plan.buckets if b.slots == ("wte",)), None) \
            if plan.grid.embedding is not None else None
        # optim.clip_grad_norm: the global norm once every bucket is reduced, before any update
        self.clip = None if not cfg.optim.clip_grad_norm else GradClip(
            plan, state.model, lambda lo, hi: self.state.optimizer.grad_of(lo, hi), self._update_ranges,
            cfg.optim.clip_grad_norm)

    def run(self, step: int, x_all, y_all, votes=None) -> StepResult:
        """Global step ``step`` on this rank's rows ``x_all``, ``y_all`` (host arrays), judged and
        (where the policy lets it) applied. ``votes()``: numbers of the caller's that every rank needs
        summed (a checkpoint due, stop signals), asked for just before the step's statistics
        all-reduce, which carries them. Collective over the plan's groups."""
        launched = self.plan.device.launches()
        optimizer, reducer, lr = self.state.optimizer, self.reducer, self.schedule.lr(step)
        scale = self.policy.loss_scale   # fp16: the loss's gradient times S, the average divided by S
        reducer.start(scale=1.0 / (self.plan.dp.size * self.plan.micro_batches * scale), step=step)
        if self.params is not None:
            self.params.begin_step()
        self.runner.forward_backward(step, x_all, y_all, self._totals, reducer, scale)
        # where nothing can drop the update (the policy does not wait for its verdict), it runs before
        # the statistics all-reduce on every rank: following the buckets as they are reduced, unless
        # something needs all of them first (clipping's norm, LAMB's and LARS's per-parameter norms, a
        # graph capture, which records every launch on the stream, the communication thread's too)
        early = not self.policy.waits
        if early:
            optimizer.begin_step(step, lr)
        following = early and not (self.clip is not None or getattr(optimizer, "whole_gradient", False)
                                   or self.runner.update_waits(optimizer, self._update_ranges))
        self._reduce(step, following)
        if self.clip is not None:   # before the update: the gradient is clipped once
            with self.timers("optimizer"), self.watchdog.watch("gradient norm all-reduce", f"step {step}", step):
                self.clip.apply()
        if early and not following:
            self._update_all(step)
        sums = self._judge(step, votes)
        outcome, reason = self.policy.decide(step, sums[0] / sums[2], int(sums[3]), int(sums[4]))
        if outcome == APPLIED and not early:
            optimizer.begin_step(step, lr)
            self._update_all(step)
        elif outcome == SKIPPED and self.state.compression is not None:
            self.state.compression.undo_step()   # residuals (and velocities) hold the bad gradient too
        if self.params is not None:
            self.params.end_step()
        return StepResult(
            step, outcome, reason, float(sums[0]), float(sums[1]), float(sums[2]), int(sums[3]), int(sums[4]),
            tuple(int(v) for v in sums[5:]), lr, None if self.policy.scaler is None else scale,
            clip={} if self.clip is None else self.clip.metrics(), comm=self._comm_metrics(),
            pipeline=self.runner.metrics(), tensor={} if self.plan.tensor is None else self.plan.tensor.take(),
            phases=self.timers.pop(), op_times=self.op_times.pop() if self.op_times else {},
            launches=None if launched is None else self.plan.device.launches() - launched)

    def score(self, x_host, y_host) -> tuple:
        """(loss_sum, correct, predictions) of evaluation rows ``x_host``, ``y_host`` on this rank: a
        forward only, through the runner (a pipeline's stages pass it along; counted on the last)."""
        return self.runner.score(x_host, y_host)

    def gather_only(self) -> None:
        """ZeRO-3: the parameter gathers of an evaluation forward without computing it. Collective
        over the data group."""
        self.runner.gather_only()

    def _reduce(self, step: int, following: bool) -> None:
        """Wait for every bucket's reduction (the ``allreduce`` phase is the exposed wait; the
        overlapped part hides in backward); a pipeline's tied table summed between its two stages;
        with ``following``, each bucket's update as soon as it is reduced."""
        behind = None   # an offloaded optimizer's: the bucket whose update waits for the next one's copy
        for bucket, name in zip(self.plan.buckets, self._bucket_names):
            with self.timers("allreduce"), self.watchdog.watch("gradient all-reduce", f"{name}, step {step}", step):
                self.reducer.wait(bucket)
            if bucket.index == self._tied:
                self.runner.sum_tied(self.state.optimizer.grad_of(*self._range(bucket)), step)
            if following:
                behind = self._update_next(step, bucket, name, behind)
        if behind is not None:
            self._update(step, *behind)

    def _judge(self, step: int, votes) -> np.ndarray:
        """This rank's statistics (read from the device once), then their sums over the world:
        loss_sum, correct, predictions, the ranks whose loss held a NaN or Inf, those that found one
        in their share of the averaged gradient, then ``votes()``. One all-reduce, collective."""
        world, model = self.plan.world, self.state.model
        loss_sum, correct = self.plan.device.to_host(self._totals)   # the step's one read of its statistics
        grad_nonfinite = self.reducer.nonfinite or (self.clip is not None and not math.isfinite(self.clip.norm))
        sums = np.array([loss_sum, correct, self.state.sampler.batch * model.targets_per_row,
                         not math.isfinite(loss_sum), grad_nonfinite, *(votes() if votes else ())], np.float64)
        if not self.plan.grid.scores:   # a data group's tensor ranks computed the same loss on the same rows;
            sums[:3] = 0.0               # a pipeline's earlier stages none
        with self.watchdog.watch("step statistics all-reduce", f"step {step}", step):
            world.comm.Allreduce(_in_place(), sums)
        return sums

    def _update_all(self, step) -> None:
        """The optimizer on every bucket, all reduced (and clipped), in order; LAMB's and LARS's trust
        ratios first."""
        self._prepare(step)
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
        plan = self.plan
        lo, hi = self._range(bucket)
        with self.timers("optimizer"):
            if self.params is not None:   # ZeRO-3: the bucket's gathered copy is stale from here on
                self.params.stale(bucket.index)
            self.runner.update(self.state.optimizer, lo, hi)
        if plan.shards is None or self.params is not None:   # (ZeRO-3 gathers before the next use)
            return
        with self.timers("allgather"), self.watchdog.watch("parameter all-gather", f"{name}, step {step}", step):
            plan.param_gather.allgather(self.state.model.flat.data[bucket.lo:bucket.hi])

    def _range(self, bucket) -> tuple[int, int]:
        """The flat range the optimizer updates for ``bucket`` (ZeRO: this rank's chunk of it)."""
        return (bucket.lo, bucket.hi) if self.plan.shards is None else self.plan.shards.pieces[bucket.index][:2]

    def _comm_metrics(self) -> dict:
        """The step's communication for the metrics: times, bytes reduced and, per rank, bytes sent
        against the dense all-reduce's (2 (p-1)/p of the buckets), with the compressor's figures."""
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


def _in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE

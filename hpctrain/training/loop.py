"""The run loop: many steps, each judged; checkpoints, evaluation, progress, stop signals.

:meth:`RunLoop.run` is collective, on every rank. Per step: read this rank's rows of the batch,
run the :class:`~hpctrain.training.step.Step` (the update too unless the numeric guard defers
it), one small all-reduce of the step's statistics (loss, accuracy, NaN/Inf seen, checkpoint
due, stop signals received) that every rank then judges alike, the update or the guard's policy,
then saves, metrics and the progress line. The stall watchdog watches the whole run.

The loop takes its parts explicitly: the plan and the training state, the step, the data, the
checkpoints, the numeric guard, and what it reports to and is watched by (log, metrics, timers,
watchdog, progress marks, stop signal, fault hooks; a tracer, per-op times and the GEMM peak when
asked for). :meth:`RunLoop.run` starts and stops the watchdog, installs the stop signal around
the steps when ``own_signal`` says it is its to install, and closes the metrics and progress
files at the end; everything else stays with whoever built it.
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np

from .. import __version__
from ..errors import EXIT_CHECKPOINTED
from ..observe import memory
from ..observe.log import format_eta
from ..reliability.signals import STOP_SIGNALS
from .plan import memory_of


def _shares(global_batch: int, size: int) -> str:
    """How the global batch splits over ranks, for the start-up line."""
    b, extra = divmod(global_batch, size)
    if not extra:
        return f"{b} x {size}"
    return f"{b + 1} x {extra} + {b} x {size - extra} (uneven shares, gradients weighted by share)"


class RunLoop:
    """Trains ``state`` to ``train.steps`` (or a stop signal) with ``stepper`` (a
    :class:`~hpctrain.training.step.Step`), as ``plan`` lays it out. ``own_signal``: install
    ``stop_signal`` (a :class:`~hpctrain.reliability.signals.StopSignal`) around the steps; False
    when the caller installed it already (the CLI does, before anything else)."""

    def __init__(self, plan, state, stepper, data, checkpoints, guard, *, log, metrics, timers, watchdog, progress,
                 stop_signal, own_signal=False, faults=None, tracer=None, op_times=None, peak_flops=None,
                 ranges=None):
        self.plan, self.state, self.stepper, self.data = plan, state, stepper, data
        self.checkpoints, self.guard = checkpoints, guard
        self.log, self.metrics, self.timers, self.watchdog = log, metrics, timers, watchdog
        self.progress, self.stop_signal, self.own_signal, self.faults = progress, stop_signal, own_signal, faults
        self.tracer, self.op_times, self.peak_flops = tracer, op_times, peak_flops
        self.ranges = ranges  # NVTX (train.nvtx): a range per step

    def run(self) -> dict:
        """Train to ``train.steps`` or a stop signal; the result: steps, seconds, throughput,
        ``stopped_by``, the final evaluation and whether the targets were met. Collective."""
        self.watchdog.start()
        try:
            return self._loop()
        finally:
            self.metrics.close()  # after the final evaluation's line
            self.progress.close()
            self.watchdog.stop()

    def _save(self, why: str = "") -> None:
        step = self.state.step
        with self.watchdog.watch("checkpoint save", f"step {step}{why}", step, 10):
            self.checkpoints.save(self.state)

    def _start_up_lines(self) -> None:
        plan, cfg, world, log, state = self.plan, self.plan.cfg, self.plan.world, self.log, self.state
        tc, data, model = cfg.train, self.data, state.model
        tensor = plan.grid.tensor is not None or plan.pipeline > 1   # this rank holds part of the model
        log.info(f"hpctrain {__version__}: {world.size} rank(s) on {world.n_nodes} node(s), "
                 f"device {plan.device.describe()}, allreduce {cfg.dist.allreduce} "
                 f"(MPI staging: {plan.staging.mode}; {len(plan.buckets)} bucket(s), "
                 f"overlap {'on' if cfg.dist.overlap else 'off'}" + (f", zero {cfg.dist.zero}" if cfg.dist.zero else "")
                 + (f", compress {cfg.dist.compress} scope {cfg.dist.compress_scope}"
                    + (f" from step {cfg.dist.compress_start_step}" if cfg.dist.compress_start_step else "")
                    + (" with momentum correction" if cfg.dist.compress_momentum else "")
                    if state.compression else "")
                 + "), "
                 + (f"{plan.grid.describe()}, " if tensor else "")
                 + f"global batch {tc.global_batch} = {_shares(tc.global_batch, plan.dp.size)}, "
                 f"{model.flat.size:,} parameters"
                 + (" on this rank" if tensor else "") + ", "
                 f"{state.sampler.steps_per_epoch} steps/epoch; data: {data.describe}")
        log.info(memory.describe(memory_of(plan, model, state.optimizer, state.sampler), cfg.dist.zero, plan.dp.size))
        if plan.pipeline > 1:
            from .schedules import bubble_fraction

            p, m = plan.pipeline, plan.micro_batches
            log.info(f"pipeline: {p} stages of {list(plan.stage_counts)} block(s), schedule "
                     f"{cfg.dist.pipeline_schedule}, {m} micro-batch(es) per step: each stage idles about "
                     f"{bubble_fraction(p, m):.0%} of a step ((p - 1) / (m + p - 1); the metrics' t_pipeline is "
                     f"rank 0's wait)" + ("" if m >= p else f"; with fewer micro-batches than stages 1f1b holds all "
                                          f"m as gpipe does: raise train.grad_accum_steps to {p} or more"))
        # (under zero 3 only its own advice: the gradient pool it shares with zero 2 is its business)
        advice = memory.zero3_advice(plan, model.flat) if cfg.dist.zero == 3 else memory.zero2_advice(plan, model.flat)
        if advice:
            log.warn(advice)
        peak = self.peak_flops  # this machine's GEMM peak over all ranks (FLOP/s), or None: no MFU
        if peak:
            log.info(f"MFU is model FLOPs/s over the GEMM peak measured at start-up: {peak / 1e9:,.1f} GFLOP/s "
                     f"over {world.size} rank(s) ({model.flops_per_row / model.targets_per_row / 1e6:,.2f} MFLOP "
                     f"per {data.units[:-1]} for forward + backward)")

    def _loop(self) -> dict:
        plan, state, cfg, log, guard = self.plan, self.state, self.plan.cfg, self.log, self.guard
        tc, data, ckpt = cfg.train, self.data, self.checkpoints
        per_row = state.model.targets_per_row  # predictions per row: the loss is their mean
        units, peak = data.units, self.peak_flops
        self._start_up_lines()
        window = np.zeros(3)  # loss_sum, correct, predictions since the last progress line
        t_start = t_window = time.perf_counter()
        eval_total, final_scores = 0.0, None
        first_step, stopped_by = state.step, None
        if guard.policy == "rollback" and ckpt.saved_step is None and state.step < tc.steps:
            self._save(", for guard.nonfinite=rollback")  # something to roll back to
        try:
            with self.stop_signal if self.own_signal else contextlib.nullcontext():
                while state.step < tc.steps:
                    t0, launches0 = time.perf_counter(), plan.device.launches()
                    if state.step in guard.skip_steps:
                        log.info(f"guard: stepping over the batch of step {state.step} (bad before the rollback)")
                        state.step += 1
                        self.progress.mark("step", state.step)
                        if ckpt.step_due(state.step) or (tc.steps == state.step and cfg.checkpoint.save_final):
                            self._save()
                            self.metrics.sync()
                        continue
                    if self.ranges is None:
                        stats = self._step_and_judge()
                    else:
                        with self.ranges(f"step {state.step + 1}"):
                            stats = self._step_and_judge()
                    if stats is None:  # rolled back
                        continue
                    bad = stats.bad
                    if bad is None:
                        window += stats.sums[:3]
                    # fp16: the scale this step's gradient was computed with, and whether it overflowed
                    scaled = {} if state.loss_scale is None else {"loss_scale": state.model.loss.loss_scale,
                                                                  "overflow": stats.overflow}
                    state.step += 1
                    self.progress.mark("step", state.step)
                    signalled = stats.signalled
                    saved = bool(signalled or stats.time_due or ckpt.step_due(state.step)
                                 or tc.steps == state.step and cfg.checkpoint.save_final)
                    if saved:
                        with self.timers("checkpoint"):
                            self._save()
                    split = self.timers.pop()
                    tensor = plan.tensor.take() if plan.tensor is not None else {}  # this step's, before evaluation
                    op_split = self.op_times.pop() if self.op_times else {}  # before evaluation's ops
                    # a GPU's host-side launches this step (before evaluation's): kernels, cuBLAS, graphs
                    launched = {} if launches0 is None else {"launches": plan.device.launches() - launches0}
                    step_time = time.perf_counter() - t0
                    rate = _rates(tc.global_batch, per_row, state.model.flops_per_row, peak, step_time)
                    if self.tracer is not None:
                        self.tracer.complete("step", t0, "step", {"step": state.step})  # as in the metrics
                    scores = None  # evaluated at eval_every and at the last step (not on the way out after a signal)
                    if data.eval_shard and (state.step == tc.steps or not signalled and tc.eval_every
                                            and state.step % tc.eval_every == 0):
                        t_eval = time.perf_counter()
                        scores = self.evaluate(whole=state.step == tc.steps)
                        final_scores = scores if state.step == tc.steps else None
                        eval_s = time.perf_counter() - t_eval
                        if plan.tensor is not None:
                            plan.tensor.take()  # evaluation's forward all-reduces are not a step's
                        t_window, eval_total = t_window + eval_s, eval_total + eval_s  # rates count training only
                    sums = stats.sums
                    self.metrics.write(step=state.step, epoch=state.sampler.position(state.step - 1)[0],
                                       loss=sums[0] / sums[2], accuracy=sums[1] / sums[2],
                                       lr=self.stepper.schedule.lr(state.step - 1), step_time=step_time,
                                       **self.stepper.comm_metrics(), **self.stepper.clip_metrics(),
                                       **self.stepper.pipeline_metrics(),
                                       **tensor, **rate,
                                       bad_steps=guard.bad_steps, skipped=bad is not None or stats.overflow,
                                       **scaled,
                                       **memory.measured(plan.device),
                                       **{f"t_{k}": v for k, v in split.items()},
                                       **op_split, **launched,
                                       **({f"val_{k}": v for k, v in scores.items()} if scores else {}))
                    if saved:  # the records of the steps the checkpoint holds survive a crash
                        self.metrics.sync()
                    if signalled and state.step < tc.steps:  # at the last step: finished, exit normally
                        stopped_by = ", ".join(f"{n} received on {c} rank(s)" for n, c in signalled.items())
                        log.info(f"stopping at step {state.step}: {stopped_by}; checkpoint saved; exit code "
                                 f"{EXIT_CHECKPOINTED} (resume with --resume auto)")
                        break
                    if (state.step % tc.log_every == 0 or state.step == tc.steps) and window[2]:
                        now = time.perf_counter()
                        rate = window[2] / (now - t_window)  # predictions per second: samples or tokens
                        eta = (now - t_start) / max(1, state.step - first_step) * (tc.steps - state.step)
                        mfu = f" | MFU {100 * rate * state.model.flops_per_row / per_row / peak:.1f}%" if peak else ""
                        log.progress(f"step {state.step:>6}/{tc.steps} | loss {window[0] / window[2]:.4f} | "
                                     f"acc {100 * window[1] / window[2]:5.1f}% | {rate:,.0f} {units}/s{mfu} | "
                                     f"lr {self.stepper.schedule.lr(state.step - 1):.4g} | ETA {format_eta(eta)}")
                        window[:] = 0
                        t_window = now
                    if scores and state.step < tc.steps:
                        log.info(f"eval at step {state.step}: {describe_eval(scores)}")
        finally:
            if self.tracer is not None:
                self.tracer.save()
        elapsed = time.perf_counter() - t_start - eval_total
        result = {"steps": state.step, "seconds": elapsed, "stopped_by": stopped_by, "eval": None,
                  "samples_per_s": (state.step - first_step) * tc.global_batch / elapsed if elapsed else 0.0,
                  "bad_steps": guard.bad_steps, "targets_met": True}
        result[f"{units}_per_s"] = result["samples_per_s"] * per_row
        if stopped_by is not None:
            return result
        log.info(f"done: {state.step} steps in {elapsed:.1f} s ({result[f'{units}_per_s']:,.0f} {units}/s)"
                 + (f", {guard.bad_steps} bad step(s) ({guard.policy})" if guard.bad_steps else ""))
        if data.eval_shard:
            # the last step's evaluation; a run resumed at its last step evaluates here
            result["eval"] = final_scores or self.evaluate(whole=True)
            result["targets_met"] = self._final_verdicts(result["eval"])
        elif tc.target_accuracy or tc.target_val_bpb or tc.target_bpb_vs_bigram:
            result["targets_met"] = False
        return result

    def _step_and_judge(self):
        """Step ``state.step`` and judge it from its global statistics: the update, the guard's skip
        (the compressors' state undone too), or a rollback (returns None then; abort raises)."""
        plan, state, guard, wd = self.plan, self.state, self.guard, self.watchdog
        step = state.step
        if self.faults is not None:
            self.faults.pace()  # a test's slow step, outside the timed phases
        with self.timers("data"):
            x_all, y_all = self.data.reader.batch(step)
            if self.faults is not None:
                x_all = self.faults.before_step(step, x_all)
        scaler = state.loss_scale  # fp16: an overflowing step is the loss scale's to skip, so updates wait
        own = self.stepper.run(step, x_all, y_all, update=not guard.deferred and scaler is None)
        judged = _Judged.gather(plan, self.stop_signal, self.checkpoints, own, state.sampler.batch
                                * state.model.targets_per_row, wd, step)
        if scaler is not None and scaler.judge(not judged.sums[4], not judged.sums[5]):
            judged.overflow = True   # not applied; the scale halved (every rank judged the same sums;
            return judged            # fp16 runs without compression, whose residuals would need undoing)
        judged.bad = guard.verdict(step, judged.sums[0] / judged.sums[2], judged.sums[4], judged.sums[5])
        if judged.bad is not None and guard.bad_step(step, judged.bad) == "rollback":  # abort raises
            self.timers.pop()
            if self.op_times:
                self.op_times.pop()  # the rolled-back step's kernels are no step's split
            if plan.tensor is not None:
                plan.tensor.take()  # nor its tensor all-reduces
            with wd.watch("checkpoint load", f"rollback from step {step}", step, 10):
                self.checkpoints.rollback(state)
            return None
        if judged.bad is None:
            if guard.deferred or scaler is not None:
                self.stepper.apply_update(step)
            if scaler is not None:
                scaler.applied()
        elif state.compression is not None:
            state.compression.undo_step()  # residuals (and velocities) hold the bad gradient too
        return judged

    def _final_verdicts(self, scores: dict) -> bool:
        """Log the final evaluation against the targets; whether every target was met."""
        tc, data, met_all, verdicts = self.plan.cfg.train, self.data, True, []
        if tc.target_accuracy:
            met = scores["accuracy"] >= tc.target_accuracy
            verdicts.append(f"target {100 * tc.target_accuracy:.1f}%: {'reached' if met else 'NOT reached'}")
            met_all &= met
        bigram = data.info.get("bigram_bpb")
        bpb_targets = [t for t in (tc.target_val_bpb, tc.target_bpb_vs_bigram * (bigram or 0)) if t]
        if bpb_targets:  # both set: the stricter one
            target = min(bpb_targets)
            met = scores.get("bpb", float("inf")) <= target
            verdicts.append(f"target {target:.4f} bpb: {'reached' if met else 'NOT reached'}")
            met_all &= met
        if "bpb" in scores and bigram:  # the honest yardstick, beside any target
            verdicts.append(f"the corpus's bigram baseline is {bigram:.4f} bpb: {scores['bpb'] / bigram:.3f}x of it")
        self.log.info(f"final eval {describe_eval(scores)}" + (f" ({'; '.join(verdicts)})" if verdicts else ""))
        return met_all

    def evaluate(self, whole: bool = False) -> dict:
        """Loss, accuracy (and for byte tokens bits per byte) on the evaluation set (all of it with
        ``whole``, else the family's subset), each rank scoring its shard; forward only, no gradient
        or optimizer state touched. Collective."""
        plan = self.plan
        totals = np.zeros(3)  # loss_sum, correct, predictions
        # a data group's tensor ranks score the same shard: each counts it once in the world's
        # sums below, loss and predictions alike, so the means are those of the data groups
        # (a pipeline's stages pass each chunk along; only the last stage's scores count)
        step = self.state.step
        chunks = self.data.eval_shard(plan.dp.rank, plan.dp.size, whole)
        if getattr(plan, "param_slots", None) is None:
            for x_host, y_host in chunks:
                totals += self.stepper.score(x_host, y_host)
        else:   # ZeRO-3: a forward gathers over the data group, whose shards may hold unequal chunk
            while True:   # counts: every rank runs as many forwards (without a chunk, gathers only)
                chunk = next(chunks, None)
                with self.watchdog.watch("evaluation chunk count", f"step {step}", step, 10):
                    more = plan.dp.comm.allreduce(chunk is not None, op=_logical_or())
                if not more:
                    break
                if chunk is None:
                    self.stepper.gather_only()
                else:
                    totals += self.stepper.score(*chunk)
        with self.watchdog.watch("evaluation all-reduce", f"step {step}", step, 10):
            plan.world.comm.Allreduce(_in_place(), totals)
        if self.op_times:
            self.op_times.pop()  # evaluation's forward passes are not part of a training step's split
        loss = float(totals[0] / totals[2])
        out = {"loss": loss, "accuracy": float(totals[1] / totals[2])}
        if self.data.bits_per_byte:
            out["bpb"] = loss / math.log(2)
        return out


class _Judged:
    """A step's statistics summed over the world (``sums``: loss_sum, correct, predictions, rank 0's
    "every_minutes is due", the ranks whose loss held a NaN or Inf, those that found one in their
    share of the averaged gradient, then per stop signal the ranks that got it: agreement at no
    extra collective), and the guard's verdict (``bad``: None for a good step)."""

    def __init__(self, sums):
        self.sums, self.bad = sums, None
        self.overflow = False   # fp16: skipped by the loss scale (not a bad step)

    @classmethod
    def gather(cls, plan, stop_signal, checkpoints, own, predictions: int, watchdog, step: int) -> "_Judged":
        world = plan.world
        sums = np.array([own.loss_sum, own.correct, predictions, world.is_root and checkpoints.time_due(),
                         own.loss_nonfinite, own.grad_nonfinite,
                         *(stop_signal.received == name for name in STOP_SIGNALS)], np.float64)
        if not plan.grid.scores:  # a data group's tensor ranks computed the same loss on the same rows;
            sums[:3] = 0.0        # a pipeline's earlier stages none
        with watchdog.watch("step statistics all-reduce", f"step {step}", step):
            world.comm.Allreduce(_in_place(), sums)  # global loss/accuracy of this step
        return cls(sums)

    @property
    def time_due(self) -> bool:
        return bool(self.sums[3])

    @property
    def signalled(self) -> dict:
        return {n: int(c) for n, c in zip(STOP_SIGNALS, self.sums[6:]) if c}


def describe_eval(scores: dict) -> str:
    """'accuracy 93.10%' for a classifier; 'loss 1.2345, 1.7810 bpb, accuracy 61.2%' for bytes."""
    if "bpb" in scores:
        return f"loss {scores['loss']:.4f}, {scores['bpb']:.4f} bpb, next-byte accuracy {100 * scores['accuracy']:.1f}%"
    return f"accuracy {100 * scores['accuracy']:.2f}%"


def _rates(global_batch: int, per_row: int, flops_per_row: int, peak, step_time: float) -> dict:
    """The step's throughput for the metrics: samples/s always; tokens/s and MFU for a language model."""
    out = {"samples_per_s": global_batch / step_time}
    if per_row > 1:
        out["tokens_per_s"] = global_batch * per_row / step_time
    if peak:
        out["mfu"] = global_batch * flops_per_row / step_time / peak
    return out


def _in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE


def _logical_or():
    from mpi4py import MPI

    return MPI.LOR

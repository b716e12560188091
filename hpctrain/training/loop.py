"""The run loop: many steps, each judged; checkpoints, evaluation, progress, stop signals.

:meth:`RunLoop.run` is collective, on every rank. Per step: read this rank's rows of the batch,
run the :class:`~hpctrain.training.step.Step` (which judges and applies its own update and returns
a :class:`~hpctrain.training.step.StepResult`), then roll back, save, evaluate, write the metrics
record and the progress line as the result and the schedule say. Whether a checkpoint is due by
time and which stop signals arrived travel with the step's statistics all-reduce (its ``votes``),
so every rank takes the same branch. The stall watchdog watches the whole run.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from ..errors import EXIT_CHECKPOINTED
from ..observe import memory
from ..observe.log import format_eta
from ..reliability.signals import STOP_SIGNALS
from .evaluation import Evaluation, describe_eval, verdicts
from .start_up_report import log_start_up
from .update_policy import ROLLBACK, SKIPPED


@dataclass
class Reporting:
    """Where a run reports: the rank-0 ``log``, the ``metrics`` file, the phase ``timers``; when
    asked, a ``tracer`` (train.trace), NVTX ``ranges`` (train.nvtx), the per-op timer
    (``op_times``, train.op_times) and this machine's GEMM peak over all ranks (``peak_flops``,
    FLOP/s: MFU)."""

    log: object
    metrics: object
    timers: object
    tracer: object = None
    ranges: object = None
    op_times: object = None
    peak_flops: float | None = None


@dataclass
class Watching:
    """What watches a run: the stall ``watchdog``, the ``progress`` marks a supervising launcher
    reads, the ``stop_signal`` (installed by the loop for its duration when ``own_signal``; the CLI
    installs it before anything else) and the tests' fault hooks (``faults``, or None)."""

    watchdog: object
    progress: object
    stop_signal: object
    own_signal: bool = False
    faults: object = None


class RunLoop:
    """Trains ``state`` to ``train.steps`` (or a stop signal) with ``stepper`` (a
    :class:`~hpctrain.training.step.Step`) as ``plan`` lays it out, on ``data``, saving through
    ``checkpoints``; ``guard``: the numeric guard (its rollback's batches are stepped over)."""

    def __init__(self, plan, state, stepper, data, checkpoints, guard, report: Reporting, watch: Watching):
        self.plan, self.state, self.stepper, self.data = plan, state, stepper, data
        self.checkpoints, self.guard, self.report, self.watch = checkpoints, guard, report, watch
        self.log, self.timers, self.watchdog = report.log, report.timers, watch.watchdog
        self.evaluation = Evaluation(plan, data, stepper, watch.watchdog, report.op_times)
        self._nvtx = report.ranges or (lambda name: contextlib.nullcontext())

    def run(self) -> dict:
        """Train to ``train.steps`` or a stop signal; the result: steps, seconds, throughput,
        ``stopped_by``, the final evaluation and whether the targets were met. Collective."""
        self.watchdog.start()
        try:
            return self._loop()
        except Exception:
            self._finish_background_save()
            raise
        finally:
            if self.report.tracer is not None:
                self.report.tracer.save()
            self.report.metrics.close()  # after the final evaluation's line
            self.watch.progress.close()
            self.watchdog.stop()

    def evaluate(self, whole: bool = False) -> dict:
        """The evaluation set's scores at the current step (:class:`~.evaluation.Evaluation`). Collective."""
        return self.evaluation.run(self.state.step, whole)

    def _loop(self) -> dict:
        state, tc, guard = self.state, self.plan.cfg.train, self.guard
        log_start_up(self.log, self.plan, state, self.data, self.report.peak_flops)
        progress = _Window(state.step, tc.steps)
        if guard.policy == "rollback" and self.checkpoints.saved_step is None and state.step < tc.steps:
            self._save(", for guard.nonfinite=rollback")  # something to roll back to
        with self.watch.stop_signal if self.watch.own_signal else contextlib.nullcontext():
            return self._steps(progress)

    def _steps(self, progress: "_Window") -> dict:
        """The steps to train.steps or a stop signal; then the run's result (:meth:`_result`)."""
        state, tc, guard = self.state, self.plan.cfg.train, self.guard
        final, stopped_by, result = None, None, None
        while state.step < tc.steps:
            if state.step in guard.skip_steps:
                self._step_over()
                continue
            t0 = time.perf_counter()
            with self._nvtx(f"step {state.step + 1}"):   # train.nvtx: a range per step
                result = self.stepper.run(state.step, *self._batch(state.step), votes=self._votes)
            if result.outcome == ROLLBACK:
                self._roll_back(result.step)
                continue
            state.step += 1
            self.watch.progress.mark("step", state.step)
            signalled = {n: c for n, c in zip(STOP_SIGNALS, result.votes[1:]) if c}
            saved, record = self._save_if_due(bool(signalled), bool(result.votes[0]), t0)
            scores = self._evaluate_if_due(signalled, progress)
            final = scores if state.step == tc.steps else None
            if result.outcome != SKIPPED:
                progress.add(result)
            self._write_metrics(result, record, scores, saved)
            if signalled and state.step < tc.steps:  # at the last step: finished, exit normally
                stopped_by = self._stopping(signalled)
                break
            self._progress_line(progress, result, scores)
        self._save_finished()
        return self._result(progress, stopped_by, final, result)

    # ---- the parts of a step's iteration ------------------------------------------------
    def _batch(self, step: int):
        """This rank's rows of global step ``step`` (the ``data`` phase), through the fault hooks."""
        faults = self.watch.faults
        if faults is not None:
            faults.pace()  # a test's slow step, outside the timed phases
        with self.timers("data"):
            x_all, y_all = self.data.reader.batch(step)
            if faults is not None:
                x_all = faults.before_step(step, x_all)
        return x_all, y_all

    def _votes(self) -> list:
        """What every rank must learn with the step's statistics (asked for as they are summed, so a
        signal that arrives during the step counts): rank 0's "checkpoint.every_minutes is due", then
        per stop signal whether this rank received it."""
        stop = self.watch.stop_signal
        return [self.plan.world.is_root and self.checkpoints.time_due(),
                *(stop.received == name for name in STOP_SIGNALS)]

    def _step_over(self) -> None:
        """A batch the guard's rollback found bad: consumed without a step (saved where one is due)."""
        state, tc = self.state, self.plan.cfg.train
        self.log.info(f"guard: stepping over the batch of step {state.step} (bad before the rollback)")
        state.step += 1
        self.watch.progress.mark("step", state.step)
        if self.checkpoints.step_due(state.step) or (tc.steps == state.step and self.plan.cfg.checkpoint.save_final):
            self._save()
            self.report.metrics.sync()

    def _save(self, why: str = "", wait: bool = True) -> None:
        """Save at this step; with ``wait`` False (a periodic save) it may go on in the background
        (``checkpoint.async_save``)."""
        step = self.state.step
        with self.watchdog.watch("checkpoint save", f"step {step}{why}", step, 10):
            if wait or not self.plan.cfg.checkpoint.async_save:
                self.checkpoints.save(self.state)
            else:
                self.checkpoints.save(self.state, wait=False, watch=lambda: self.watchdog.watch_background(
                    "checkpoint save", f"step {step}, in the background", step, 10))

    def _save_finished(self) -> None:
        """The end of the steps: a save still in flight in the background is committed (or fails) now."""
        pending = self.checkpoints.in_flight if self.plan.cfg.checkpoint.async_save else None
        if pending is not None:
            with self.watchdog.watch("checkpoint save", f"step {pending}, in the background", pending, 10):
                self.checkpoints.wait()

    def _finish_background_save(self) -> None:
        """The run ends by an error: the save in flight in the background is committed first, watched
        as a save (every rank's writer runs on communicators of its own, so it finishes while the
        training threads have stopped); its own failure only warns (the error that ends the run is
        the one to report)."""
        pending = self.checkpoints.in_flight if self.plan.cfg.checkpoint.async_save else None
        if pending is None:
            return
        self.log.warn(f"finishing the checkpoint of step {pending} (being written in the background) before the "
                      f"error ends the run")
        try:
            with self.watchdog.watch("checkpoint save", f"step {pending}, in the background, before an error exit",
                                     pending, 10):
                self.checkpoints.wait()
        except Exception as exc:  # noqa: BLE001 - the run's own error is raised after this
            self.log.warn(f"the checkpoint of step {pending} could not be finished: {exc}")

    def _roll_back(self, step: int) -> None:
        """The guard's rollback of bad step ``step``: the newest checkpoint loaded again."""
        with self.watchdog.watch("checkpoint load", f"rollback from step {step}", step, 10):
            self.checkpoints.rollback(self.state)

    def _save_if_due(self, signalled: bool, timed: bool, t0: float) -> tuple[bool, dict]:
        """Save at a stop signal, when checkpoint.every_minutes is due (``timed``), at
        checkpoint.every_steps, or at the last step with checkpoint.save_final; the step ends here.
        A periodic save may go on in the background (checkpoint.async_save); a signal's and the
        last step's finish here. (whether it saved, the step's time since ``t0`` (perf_counter) and
        the save's, ``t_checkpoint``: what it stalled the step, for its record); the tracer's span of
        the step."""
        cfg, step, record = self.plan.cfg, self.state.step, {}
        last = cfg.train.steps == step
        saved = signalled or timed or self.checkpoints.step_due(step) or last and cfg.checkpoint.save_final
        if saved:
            with self.timers("checkpoint"):
                self._save(wait=signalled or last)
            record = {f"t_{k}": v for k, v in self.timers.pop().items()}
        if self.report.tracer is not None:
            self.report.tracer.complete("step", t0, "step", {"step": step})  # as in the metrics
        return bool(saved), {"step_time": time.perf_counter() - t0, **record}

    def _stopping(self, signalled: dict) -> str:
        """Says why the run stops at this step (a stop signal); what the run result calls it."""
        stopped_by = ", ".join(f"{n} received on {c} rank(s)" for n, c in signalled.items())
        self.log.info(f"stopping at step {self.state.step}: {stopped_by}; checkpoint saved; exit code "
                      f"{EXIT_CHECKPOINTED} (resume with --resume auto)")
        return stopped_by

    def _evaluate_if_due(self, signalled: dict, progress: "_Window") -> dict | None:
        """The evaluation at train.eval_every and at the last step (not on the way out after a
        signal); its seconds do not count in the training rates."""
        step, tc = self.state.step, self.plan.cfg.train
        if not self.data.eval_shard or not (step == tc.steps or not signalled and tc.eval_every
                                            and step % tc.eval_every == 0):
            return None
        t0 = time.perf_counter()
        scores = self.evaluate(whole=step == tc.steps)
        progress.exclude(time.perf_counter() - t0)
        return scores

    def _write_metrics(self, result, record: dict, scores: dict | None, saved: bool) -> None:
        """The step's record; synced to disk with a checkpoint (the records of the steps the
        checkpoint holds survive a crash)."""
        state, tc = self.state, self.plan.cfg.train
        self.report.metrics.write(
            step=state.step, epoch=state.sampler.position(state.step - 1)[0], **result.metrics(), **record,
            **_rates(tc.global_batch, state.model.targets_per_row, state.model.flops_per_row,
                     self.report.peak_flops, record["step_time"]),
            bad_steps=self.guard.bad_steps, **memory.measured(self.plan.device),
            **({f"val_{k}": v for k, v in scores.items()} if scores else {}))
        if saved:
            self.report.metrics.sync()

    def _progress_line(self, progress: "_Window", result, scores: dict | None) -> None:
        """Every train.log_every steps and at the last: the progress line; an evaluation's line."""
        step, tc, model, peak = self.state.step, self.plan.cfg.train, self.state.model, self.report.peak_flops
        if (step % tc.log_every == 0 or step == tc.steps) and progress.predictions:
            rate, eta = progress.take(step)   # predictions per second: samples or tokens
            mfu = f" | MFU {100 * rate * model.flops_per_row / model.targets_per_row / peak:.1f}%" if peak else ""
            self.log.progress(f"step {step:>6}/{tc.steps} | loss {progress.loss:.4f} | acc "
                              f"{100 * progress.accuracy:5.1f}% | {rate:,.0f} {self.data.units}/s{mfu} | lr "
                              f"{result.lr:.4g} | ETA {format_eta(eta)}")
            progress.clear()
        if scores and step < tc.steps:
            self.log.info(f"eval at step {step}: {describe_eval(scores)}")

    def _result(self, progress: "_Window", stopped_by, final, last) -> dict:
        """The run's result (:meth:`run`), with its last step's :class:`~.step.StepResult` (``last_step``,
        None if it took none)."""
        state, tc, units = self.state, self.plan.cfg.train, self.data.units
        elapsed = progress.training_seconds()
        result = {"steps": state.step, "seconds": elapsed, "stopped_by": stopped_by, "eval": None,
                  "samples_per_s": (state.step - progress.first) * tc.global_batch / elapsed if elapsed else 0.0,
                  "bad_steps": self.guard.bad_steps, "targets_met": True, "last_step": last}
        result[f"{units}_per_s"] = result["samples_per_s"] * state.model.targets_per_row
        if stopped_by is not None:
            return result
        self.log.info(f"done: {state.step} steps in {elapsed:.1f} s ({result[f'{units}_per_s']:,.0f} {units}/s)"
                      + (f", {self.guard.bad_steps} bad step(s) ({self.guard.policy})" if self.guard.bad_steps else ""))
        if self.data.eval_shard:
            # the last step's evaluation; a run resumed at its last step evaluates here
            result["eval"] = final or self.evaluate(whole=True)
            result["targets_met"], line = verdicts(tc, self.data, result["eval"])
            self.log.info(line)
        elif tc.target_accuracy or tc.target_val_bpb or tc.target_bpb_vs_bigram:
            result["targets_met"] = False
        return result

class _Window:
    """The progress line's figures since it was last printed (loss, correct and predictions of the
    steps that were not skipped, their seconds without evaluation), and the run's own clock."""

    def __init__(self, first_step: int, steps: int):
        self.first, self.steps = first_step, steps
        self.t_start = self.t_window = time.perf_counter()
        self.eval_seconds = 0.0
        self.clear()

    def clear(self) -> None:
        self.loss_sum = self.correct = self.predictions = 0.0

    def add(self, result) -> None:
        self.loss_sum += result.loss_sum
        self.correct += result.correct
        self.predictions += result.predictions

    def exclude(self, seconds: float) -> None:
        """Evaluation's seconds: not training's, in the rates and the ETA."""
        self.t_window += seconds
        self.eval_seconds += seconds

    loss = property(lambda self: self.loss_sum / self.predictions)
    accuracy = property(lambda self: self.correct / self.predictions)

    def take(self, step: int) -> tuple[float, float]:
        """(predictions per second since the last line, seconds left to the last step)."""
        now = time.perf_counter()
        rate = self.predictions / (now - self.t_window)
        eta = (now - self.t_start) / max(1, step - self.first) * (self.steps - step)
        self.t_window = now
        return rate, eta

    def training_seconds(self) -> float:
        return time.perf_counter() - self.t_start - self.eval_seconds


def _rates(global_batch: int, per_row: int, flops_per_row: int, peak, step_time: float) -> dict:
    """The step's throughput for the metrics: samples/s always; tokens/s and MFU for a language model."""
    out = {"samples_per_s": global_batch / step_time}
    if per_row > 1:
        out["tokens_per_s"] = global_batch * per_row / step_time
    if peak:
        out["mfu"] = global_batch * flops_per_row / step_time / peak
    return out

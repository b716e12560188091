"""The run loop: steps, the per-step verdict, checkpoints, progress, evaluation, stop signals.

:func:`run` is ``Trainer.run``: collective, on every rank. Per step: compute
(forward, backward, all-reduce; the update too unless the numerical guard
defers it), one small all-reduce of the step's statistics (loss, accuracy,
NaN/Inf seen, checkpoint due, stop signals received) that every rank then
judges alike, the update or the guard's policy, then saves, metrics and the
progress line. The stall watchdog watches the whole run.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from . import __version__, memory
from .ckpt.signals import STOP_SIGNALS
from .errors import EXIT_CHECKPOINTED
from .log import format_eta


def run(trainer) -> dict:
    """Train ``trainer`` (a :class:`~hpctrain.train.Trainer`) to ``train.steps`` or a stop signal."""
    trainer.watchdog.start()
    try:
        return _loop(trainer)
    finally:
        trainer.metrics.close()  # after the final evaluation's line
        trainer.progress.close()
        trainer.watchdog.stop()


def _shares(global_batch: int, size: int) -> str:
    """How the global batch splits over ranks, for the start-up line."""
    b, extra = divmod(global_batch, size)
    if not extra:
        return f"{b} x {size}"
    return f"{b + 1} x {extra} + {b} x {size - extra} (uneven shares, gradients weighted by share)"


def _loop(trainer) -> dict:
    cfg, world, log, wd, guard = trainer.cfg, trainer.world, trainer.log, trainer.watchdog, trainer.guard
    tc, b, data = cfg.train, trainer.sampler.batch, trainer.data
    per_row = trainer.model.targets_per_row  # predictions per row: the loss is their mean
    units = data.units
    log.info(f"hpctrain {__version__}: {world.size} rank(s) on {world.n_nodes} node(s), "
             f"device {trainer.device.describe()}, allreduce {cfg.dist.allreduce} "
             f"(MPI staging: {trainer.staging.mode}; {len(trainer.buckets)} bucket(s), "
             f"overlap {'on' if cfg.dist.overlap else 'off'}" + (f", zero {cfg.dist.zero}" if cfg.dist.zero else "")
             + (f", compress {cfg.dist.compress} scope {cfg.dist.compress_scope}"
                + (f" from step {cfg.dist.compress_start_step}" if cfg.dist.compress_start_step else "")
                + (" with momentum correction" if cfg.dist.compress_momentum else "")
                if trainer.compression else "")
             + "), "
             + (f"{trainer.grid.describe()}, " if trainer.grid.tensor is not None else "")
             + f"global batch {tc.global_batch} = {_shares(tc.global_batch, trainer.dp.size)}, "
             f"{trainer.model.flat.size:,} parameters"
             + (" on this rank" if trainer.grid.tensor is not None else "") + ", "
             f"{trainer.sampler.steps_per_epoch} steps/epoch; data: {data.describe}")
    log.info(memory.describe(memory.computed(trainer), cfg.dist.zero, trainer.dp.size))
    advice = memory.zero2_advice(trainer)
    if advice:
        log.warn(advice)
    peak = trainer.peak_flops  # this machine's GEMM peak over all ranks (FLOP/s), or None: no MFU
    if peak:
        log.info(f"MFU is model FLOPs/s over the GEMM peak measured at start-up: {peak / 1e9:,.1f} GFLOP/s "
                 f"over {world.size} rank(s) ({trainer.model.flops_per_row / per_row / 1e6:,.2f} MFLOP per "
                 f"{units[:-1]} for forward + backward)")
    window = np.zeros(3)  # loss_sum, correct, predictions since the last progress line
    # per step, summed over ranks: loss_sum, correct, rows, rank 0's "every_minutes is due",
    # the ranks whose loss held a NaN or Inf, those that found one in (their share of) the
    # averaged gradient (BucketedAllreduce.nonfinite), then per stop signal the ranks
    # that got it (agreement at no extra collective)
    stats = np.zeros(6 + len(STOP_SIGNALS))
    copy = trainer.grid.tensor_rank != 0  # this rank's loss and rows are its tensor rank 0's, counted there
    t_start = t_window = time.perf_counter()
    eval_total, final_scores = 0.0, None
    first_step, stopped_by = trainer.step, None
    ckpt = trainer.checkpoints
    if guard.policy == "rollback" and ckpt.saved_step is None and trainer.step < tc.steps:
        with wd.watch("checkpoint save", f"step {trainer.step}, for guard.nonfinite=rollback", trainer.step, 10):
            ckpt.save(trainer)  # something to roll back to
    try:
        with trainer.stop_signal if trainer._own_signal else contextlib.nullcontext():
            while trainer.step < tc.steps:
                t0 = time.perf_counter()
                if trainer.step in guard.skip_steps:
                    log.info(f"guard: stepping over the batch of step {trainer.step} (bad before the rollback)")
                    trainer.step += 1
                    trainer.progress.mark("step", trainer.step)
                    if ckpt.step_due(trainer.step) or (tc.steps == trainer.step and cfg.checkpoint.save_final):
                        with wd.watch("checkpoint save", f"step {trainer.step}", trainer.step, 10):
                            ckpt.save(trainer)
                    continue
                loss_sum, correct, nonfinite = trainer.compute_step(update=not guard.deferred)
                stats[:] = (loss_sum, correct, b * per_row, world.is_root and ckpt.time_due(), *nonfinite,
                            *(trainer.stop_signal.received == name for name in STOP_SIGNALS))
                if copy:  # a data group's tensor ranks computed the same loss on the same rows: one counts
                    stats[:3] = 0.0
                with wd.watch("step statistics all-reduce", f"step {trainer.step}", trainer.step):
                    world.comm.Allreduce(_in_place(), stats)  # global loss/accuracy of this step
                bad = guard.verdict(trainer.step, stats[0] / stats[2], stats[4], stats[5])
                if bad is not None and guard.bad_step(trainer.step, bad) == "rollback":  # abort raises
                    trainer.timers.pop()
                    if trainer.op_times:
                        trainer.op_times.pop()  # the rolled-back step's kernels are no step's split
                    if trainer.tensor is not None:
                        trainer.tensor.take()  # nor its tensor all-reduces
                    with wd.watch("checkpoint load", f"rollback from step {trainer.step}", trainer.step, 10):
                        ckpt.rollback(trainer)
                    continue
                if bad is None:
                    if guard.deferred:
                        trainer.apply_update()
                    window += stats[:3]
                elif trainer.compression is not None:
                    trainer.compression.undo_step()  # residuals (and velocities) hold the bad gradient too
                trainer.step += 1
                trainer.progress.mark("step", trainer.step)
                signalled = {n: int(c) for n, c in zip(STOP_SIGNALS, stats[6:]) if c}
                if signalled or stats[3] or ckpt.step_due(trainer.step) or (tc.steps == trainer.step and
                                                                      cfg.checkpoint.save_final):
                    with trainer.timers("checkpoint"), wd.watch("checkpoint save", f"step {trainer.step}",
                                                             trainer.step, 10):
                        ckpt.save(trainer)
                split = trainer.timers.pop()
                tensor = trainer.tensor.take() if trainer.tensor is not None else {}  # this step's, before evaluation
                op_split = trainer.op_times.pop() if trainer.op_times else {}  # before evaluation's ops
                step_time = time.perf_counter() - t0
                rate = _rates(tc.global_batch, per_row, trainer.model.flops_per_row, peak, step_time)
                if trainer.tracer is not None:
                    trainer.tracer.complete("step", t0, "step", {"step": trainer.step})  # as in the metrics
                scores = None  # evaluated at eval_every and at the last step (not on the way out after a signal)
                if data.eval_shard and (trainer.step == tc.steps or not signalled and tc.eval_every
                                        and trainer.step % tc.eval_every == 0):
                    t_eval = time.perf_counter()
                    scores = trainer.evaluate(whole=trainer.step == tc.steps)
                    final_scores = scores if trainer.step == tc.steps else None
                    eval_s = time.perf_counter() - t_eval
                    if trainer.tensor is not None:
                        trainer.tensor.take()  # evaluation's forward all-reduces are not a step's
                    t_window, eval_total = t_window + eval_s, eval_total + eval_s  # rates count training only
                trainer.metrics.write(step=trainer.step, epoch=trainer.sampler.position(trainer.step - 1)[0],
                                   loss=stats[0] / stats[2], accuracy=stats[1] / stats[2],
                                   lr=trainer.schedule.lr(trainer.step - 1), step_time=step_time,
                                   comm_time=trainer.comm.comm_s, exposed_comm_time=trainer.comm.exposed_s,
                                   bytes_reduced=trainer.comm.bytes, allreduce=cfg.dist.allreduce,
                                   **trainer._compression_metrics(), **tensor,
                                   **rate,
                                   bad_steps=guard.bad_steps, skipped=bad is not None,
                                   **memory.measured(trainer.device),
                                   **{f"t_{k}": v for k, v in split.items()},
                                   **op_split,
                                   **({f"val_{k}": v for k, v in scores.items()} if scores else {}))
                if signalled and trainer.step < tc.steps:  # at the last step: finished, exit normally
                    stopped_by = ", ".join(f"{n} received on {c} rank(s)" for n, c in signalled.items())
                    log.info(f"stopping at step {trainer.step}: {stopped_by}; checkpoint saved; exit code "
                             f"{EXIT_CHECKPOINTED} (resume with --resume auto)")
                    break
                if (trainer.step % tc.log_every == 0 or trainer.step == tc.steps) and window[2]:
                    now = time.perf_counter()
                    rate = window[2] / (now - t_window)  # predictions per second: samples or tokens
                    eta = (now - t_start) / max(1, trainer.step - first_step) * (tc.steps - trainer.step)
                    mfu = f" | MFU {100 * rate * trainer.model.flops_per_row / per_row / peak:.1f}%" if peak else ""
                    log.progress(f"step {trainer.step:>6}/{tc.steps} | loss {window[0] / window[2]:.4f} | "
                                 f"acc {100 * window[1] / window[2]:5.1f}% | {rate:,.0f} {units}/s{mfu} | "
                                 f"lr {trainer.schedule.lr(trainer.step - 1):.4g} | ETA {format_eta(eta)}")
                    window[:] = 0
                    t_window = now
                if scores and trainer.step < tc.steps:
                    log.info(f"eval at step {trainer.step}: {describe_eval(scores)}")
    finally:
        if trainer.tracer is not None:
            trainer.tracer.save()
    elapsed = time.perf_counter() - t_start - eval_total
    result = {"steps": trainer.step, "seconds": elapsed, "stopped_by": stopped_by, "eval": None,
              "samples_per_s": (trainer.step - first_step) * tc.global_batch / elapsed if elapsed else 0.0,
              "bad_steps": guard.bad_steps, "targets_met": True}
    result[f"{units}_per_s"] = result["samples_per_s"] * per_row
    if stopped_by is not None:
        return result
    log.info(f"done: {trainer.step} steps in {elapsed:.1f} s ({result[f'{units}_per_s']:,.0f} {units}/s)"
             + (f", {guard.bad_steps} bad step(s) ({guard.policy})" if guard.bad_steps else ""))
    if data.eval_shard:
        # the last step's evaluation; a run resumed at its last step evaluates here
        scores = result["eval"] = final_scores or trainer.evaluate(whole=True)
        verdicts = []
        if tc.target_accuracy:
            met = scores["accuracy"] >= tc.target_accuracy
            verdicts.append(f"target {100 * tc.target_accuracy:.1f}%: {'reached' if met else 'NOT reached'}")
            result["targets_met"] &= met
        bigram = data.info.get("bigram_bpb")
        bpb_targets = [t for t in (tc.target_val_bpb, tc.target_bpb_vs_bigram * (bigram or 0)) if t]
        if bpb_targets:  # both set: the stricter one
            target = min(bpb_targets)
            met = scores.get("bpb", float("inf")) <= target
            verdicts.append(f"target {target:.4f} bpb: {'reached' if met else 'NOT reached'}")
            result["targets_met"] &= met
        if "bpb" in scores and bigram:  # the honest yardstick, beside any target
            verdicts.append(f"the corpus's bigram baseline is {bigram:.4f} bpb: {scores['bpb'] / bigram:.3f}x of it")
        log.info(f"final eval {describe_eval(scores)}" + (f" ({'; '.join(verdicts)})" if verdicts else ""))
    elif tc.target_accuracy or tc.target_val_bpb or tc.target_bpb_vs_bigram:
        result["targets_met"] = False
    return result


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

"""What a run says before its first step: one line each for the world and its communication, the
memory per rank, a pipeline's schedule, ZeRO's advice and the MFU yardstick (rank 0's log)."""

from __future__ import annotations

from .. import __version__
from ..observe import memory
from .plan import memory_of


def log_start_up(log, plan, state, data, peak_flops=None) -> None:
    """The run's lines before its first step (rank 0's ``log``): the world, device, communication
    and batch; the memory per rank; a pipeline's schedule; ZeRO's advice; how MFU is counted
    (``peak_flops``: the GEMM peak over all ranks, FLOP/s, or None: no MFU)."""
    cfg, world = plan.cfg, plan.world
    tc, model = cfg.train, state.model
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
    peak = peak_flops
    if peak:
        log.info(f"MFU is model FLOPs/s over the GEMM peak measured at start-up: {peak / 1e9:,.1f} GFLOP/s "
                 f"over {world.size} rank(s) ({model.flops_per_row / model.targets_per_row / 1e6:,.2f} MFLOP "
                 f"per {data.units[:-1]} for forward + backward)")


def _shares(global_batch: int, size: int) -> str:
    """How the global batch splits over ranks, for the start-up line."""
    b, extra = divmod(global_batch, size)
    if not extra:
        return f"{b} x {size}"
    return f"{b + 1} x {extra} + {b} x {size - extra} (uneven shares, gradients weighted by share)"

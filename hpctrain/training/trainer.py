"""The trainer: a run's parts built collectively, then the run loop over them.

    trainer = Trainer(cfg, world)      # every rank; start-up is watched and every error agreed
    trainer.run()                      # RunLoop(...).run(): steps, verdicts, saves, evaluation
    trainer.close()

Start-up builds, in order, each part with what it depends on: the
:class:`~hpctrain.training.plan.Plan`'s grid, groups and device (``place``), what observes the run
(NVTX ranges, the tracer, per-op timers), the data and the model, the plan's buckets and ZeRO
shares (``divide``), the optimizer and the :class:`~hpctrain.training.state.TrainingState`, the
checks every rank must pass alike, the all-reduce strategy (``plan.connect``), the compressors,
the update policy and the :class:`~hpctrain.training.step.Step`, the initial weights' broadcast,
the GEMM peak for MFU, the tracer's common clock, the checkpoint manager and the resume. Each
collective runs in a watched region, so a rank that stops during start-up ends the job with a
report. The model and its data come from the family ``model.kind`` (:mod:`hpctrain.models`).
"""

from __future__ import annotations

from fractions import Fraction

from ..ckpt.manager import CheckpointManager, check_writable
from ..ckpt.state import fresh_rng
from ..comm.collectives import Collectives
from ..comm.zero_grads import place_gradients
from ..compress.gradients import GradientCompression
from ..errors import ConfigError
from ..models import family
from ..observe.log import Log, Metrics, Timers
from ..observe.nvtx import make_ranges
from ..optim import LRSchedule, build_optimizer, peak_lr
from ..reliability.fail_together import agree
from ..reliability.faults import Faults
from ..reliability.heartbeat import Beacon
from ..reliability.numeric_guard import NumericGuard
from ..reliability.progress import Progress
from ..reliability.signals import StopSignal
from ..reliability.watchdog import Watchdog
from .loop import Reporting, RunLoop, Watching
from .plan import place
from .start_up_checks import agree_at_start_up
from .state import TrainingState
from .step import Step
from .update_policy import UpdatePolicy


class Trainer:
    """A run's parts, built collectively over ``world`` (all ranks construct it).

    ``plan``: what runs where; ``state``: what a checkpoint holds; ``stepper``: one optimizer step;
    ``checkpoints``, ``guard`` (the numeric guard), ``data``; what the run reports to (``log``,
    ``metrics``, ``timers``, ``tracer``, ``ranges``, ``op_times``) and is watched by (``watchdog``,
    ``progress``, ``stop_signal``, ``faults``). ``stop_signal``: an already installed
    :class:`StopSignal` (the CLI installs one before anything else, so a signal during start-up
    is not fatal); by default :meth:`run` installs its own for its duration.
    """

    def __init__(self, cfg, world, log: Log | None = None, stop_signal: StopSignal | None = None):
        self.cfg, self.world = cfg, world
        self.log = log or Log(world.is_root)
        # every start-up collective is watched (at 10x the limit: start-up includes local work such
        # as opening the data), so a rank that stops before training also ends the job, with a report
        self.watchdog = Watchdog(world.comm, cfg.dist.comm_timeout, self.log)  # collective (a Dup)
        self.faults = Faults(world.rank)  # the tests' hooks, read from the environment once
        self.progress = Progress(world.is_root)  # for a supervising launcher (HPCTRAIN_LAUNCH_PROGRESS)
        self.progress.mark("start", 0)
        self.beacon = Beacon(world.rank)  # heartbeats to a supervising launcher (HPCTRAIN_LAUNCH_BEACON)
        self.beacon.start()
        self.watchdog.start()
        try:
            self._start_up(cfg, world)
        finally:
            self.watchdog.stop()  # run() starts it again
        self._own_signal = stop_signal is None
        self.stop_signal = stop_signal or StopSignal()

    # ---- start-up ------------------------------------------------------------------
    def _start_up(self, cfg, world):
        """Everything __init__ builds, its collectives each in a watched region."""
        wd = self.watchdog
        self.faults.at_start_up()
        with wd.watch("start-up", "checking the data and the bucket layout on every rank", slack=10):
            # Set-up checks may fail on some ranks only (a file missing on one node):
            # agree() makes every rank raise the same error instead of hanging.
            model, optimizer, scaler = agree(world, self._build)
            plan = self.plan
            agree_at_start_up(world, plan, self.data, self.log)
        with wd.watch("start-up", f"all-reduce set-up (dist.allreduce={cfg.dist.allreduce})", slack=10):
            # strategies may run collectives while being built (auto measures), so
            # only once every rank is known to have built everything else
            plan.connect(self.log, wd)
            place_gradients(plan.allreduce, model, plan.grad_slots, plan.device)
            compression = None if cfg.dist.compress == "none" else agree(
                world, GradientCompression, cfg.dist.compress, cfg.dist.compress_scope, plan.dp, plan.staging,
                plan.allreduce, plan.buckets, model.flat, cfg.train.seed, self.log,
                cfg.dist.compress_start_step, cfg.optim.beta1 if cfg.dist.compress_momentum else 0.0,
                keep_undo=cfg.guard.nonfinite == "skip", matrix_parts=getattr(model, "matrix_parts", None))
        # per-rank generator for anything stochastic per rank (saved under /rng)
        self.state = TrainingState(model, optimizer, self.data.sampler, fresh_rng(cfg.train.seed, world.rank),
                                   compression, loss_scale=scaler)
        self.guard = NumericGuard(cfg.guard, self.log)
        if self.tracer is not None:   # each phase also a span
            from ..observe.trace import TracedTimers

            self.timers = TracedTimers(self.tracer, sync=plan.device.synchronize, ranges=self.ranges)
        else:   # waiting at each phase end serialises the GPU: only when asked
            self.timers = Timers(sync=plan.device.synchronize if cfg.train.sync_phases else None, ranges=self.ranges)
        self.stepper = Step(plan, self.state, self.schedule, UpdatePolicy(self.guard, self.state.loss_scale),
                            self.timers, self.watchdog, self.log, self.tracer, self.ranges, self.op_times)
        if plan.device.name == "cuda" and cfg.train.cuda_graphs != "off" and self.stepper.graphs_off:
            # a GPU run that keeps its launches eager: say why once
            (self.log.warn if cfg.train.cuda_graphs == "on" else self.log.info)(
                f"train.cuda_graphs = {cfg.train.cuda_graphs}: the steps run eagerly: {self.stepper.graphs_off}")
        if plan.param_slots is None:   # (ZeRO-3's ranks drew the same weights, one array at a time)
            with wd.watch("start-up", "broadcast of the initial weights", slack=10):
                # data parallelism starts from identical weights: its rank 0's (under tensor parallelism
                # each data group holds one tensor rank's pieces)
                Collectives(plan.dp, plan.device, plan.staging).Bcast(self.model.flat.data, root=0)
        with wd.watch("start-up", "GEMM peak for MFU", slack=10):
            self.peak_flops = None  # FLOP/s over all ranks; None: MFU not reported
            if self.model.flops_per_row:
                from ..observe.mfu import world_peak_flops

                self.peak_flops = world_peak_flops(world, plan.device)
        with wd.watch("start-up", "trace clock and checkpoint directory", slack=10):
            if self.tracer is not None:
                self.tracer.start(world.comm)   # the ranks' common time base
            self.checkpoints = CheckpointManager(plan, self.log, hooks=self.faults)
        with self.watchdog.watch("checkpoint load", "resume", slack=10):
            self.checkpoints.resume(self.state)  # may restore parameters, optimizer state, step and RNG
        self.metrics.begin(self.step if self.checkpoints.saved_path is not None else None)
        self.progress.mark("ready", self.step)

    def _build(self):
        """The plan, what observes the run, the data, the model and its optimizer (and fp16's loss
        scale); the checks of their arithmetic. Returns (model, optimizer, loss scaler or None). Local
        but for the grid's communicator splits."""
        cfg, world = self.cfg, self.world
        # tensor groups of dist.tensor_parallel ranks split the model; data groups across them
        # average gradients: everything data-parallel runs over plan.dp
        self.plan = plan = place(cfg, world)
        self.ranges = make_ranges(cfg.train.nvtx)  # NVTX ranges per step, phase, layer and bucket, or None
        self.tracer = None  # train.trace: spans per phase, layer and bucket (hpctrain.observe.trace.Tracer)
        if cfg.train.trace:
            from ..observe.trace import Tracer, make_trace_dir

            make_trace_dir(cfg.train.trace)
            self.tracer = Tracer(cfg.train.trace, world, sync=plan.device.synchronize)
        self.op_times = None
        if cfg.train.op_times:
            from ..observe.op_times import OpTimes

            self.op_times = OpTimes(plan.device, plan.model_device)  # wraps the devices' kernel tables
        models = family(cfg.model.kind)
        self.data = models.open_data(cfg, plan.dp, plan.device)  # tensor ranks of a data group read the same rows
        sampler, k = self.data.sampler, plan.micro_batches
        # Shares (and micro-batches) that differ: every row's loss gets the same weight, size k / G,
        # instead of 1 / (the rows of its micro-batch), so the sum over ranks scaled by 1 / (size k)
        # is the whole batch's mean. Even shares keep 1/B.
        # (exact: a model divides it by its predictions per row before rounding it, as one division would)
        row_weight = None if sampler.even and sampler.batch % k == 0 else Fraction(plan.dp.size * k,
                                                                                   cfg.train.global_batch)
        model = models.build(cfg, plan.model_device, self.data, tensor=plan.tensor, stage=plan.grid.stage,
                             row_weight=row_weight, tracer=self.tracer, ranges=self.ranges)
        if model.flat.data is not None:   # (ZeRO-3's model has no whole buffer: it takes its shares below)
            model.init(cfg.train.seed)
        self.faults.check_inputs(model.input_dtype)
        peak = peak_lr(cfg.optim, cfg.train.global_batch)
        self.schedule = LRSchedule(cfg.optim, peak, cfg.train.steps)
        plan.divide(model)
        if plan.param_slots is not None:   # ZeRO-3: each rank draws the weights and keeps its chunks
            plan.param_slots.adopt(model, model.initial_values(cfg.train.seed))
        optimizer = build_optimizer(plan.device, model.flat, cfg, model.no_decay, plan.shards,
                                    plan.grad_slots and plan.grad_slots.owned,
                                    cfg.dist.compress_start_step if cfg.dist.compress_momentum else 0,
                                    params=plan.param_slots and plan.param_slots.owned)
        scaler = None
        if cfg.train.precision == "fp16":
            from .loss_scale import LossScaler

            scaler = LossScaler(cfg.train.loss_scale, cfg.train.loss_scale_window)
        if cfg.train.exact_shares and sampler.batch % k:
            raise ConfigError(f"train.grad_accum_steps={k} does not divide the per-rank batch "
                              f"{sampler.batch} (global {cfg.train.global_batch} / {plan.dp.size} data-parallel "
                              f"ranks); "
                              f"or set train.exact_shares = false to let micro-batches differ by one row")
        if sampler.batch < k:
            raise ConfigError(f"train.grad_accum_steps={k} exceeds this rank's {sampler.batch} rows per step "
                              f"(global {cfg.train.global_batch} over {plan.dp.size} data-parallel ranks); lower it")
        if cfg.optim.schedule == "cosine" and cfg.optim.min_lr > peak:
            raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} exceeds the peak lr {peak:g} "
                              f"(after the linear scaling rule); lower optim.min_lr")
        check_writable(cfg.checkpoint.dir)
        # opened here so an unwritable path is an agreed user error, not an abort; emptied
        # after the resume unless a checkpoint was loaded (a resumed run appends to its metrics)
        self.metrics = Metrics(cfg.train.metrics, world.is_root)
        return model, optimizer, scaler

    # ---- the parts most callers reach for --------------------------------------------
    @property
    def model(self):
        return self.state.model

    @property
    def optimizer(self):
        return self.state.optimizer

    @property
    def compression(self):
        return self.state.compression

    @property
    def device(self):
        return self.plan.device

    @property
    def step(self) -> int:
        """The global step the next update makes."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    # ---- steps and the run -----------------------------------------------------------
    def loop(self) -> RunLoop:
        """The run loop over this trainer's parts."""
        return RunLoop(self.plan, self.state, self.stepper, self.data, self.checkpoints, self.guard,
                       Reporting(self.log, self.metrics, self.timers, self.tracer, self.ranges, self.op_times,
                                 self.peak_flops),
                       Watching(self.watchdog, self.progress, self.stop_signal, self._own_signal, self.faults))

    def evaluate(self, whole: bool = False) -> dict:
        """The evaluation set's loss and accuracy (see :meth:`RunLoop.evaluate`). Collective."""
        return self.loop().evaluate(whole)

    def run(self) -> dict:
        """Train to ``train.steps`` (or a stop signal); collective. See :mod:`hpctrain.training.loop`."""
        return self.loop().run()

    def close(self, code: int | None = None) -> None:
        """Close the data files and stop the heartbeats, telling a supervising launcher the exit code
        the run ends with (None: unknown, the run raised). The run is over; the trainer is not used
        again."""
        self.beacon.stop(code=code)
        self.data.close()
        if getattr(self, "checkpoints", None) is not None:
            self.checkpoints.close()   # the background writer's communicators (its save was waited for by the run)
        if getattr(self, "plan", None) is not None and self.plan.param_slots is not None:
            self.plan.param_slots.close()
        self.faults.at_exit()


"""The trainer: everything a run needs, built collectively, and one training step.

(The loop over steps is :mod:`hpctrain.loop`.) One step on every rank: read this rank's rows of the global batch -> forward
-> backward into the flat gradient -> average the gradient over ranks ->
optimizer update. Because every rank starts from rank 0's parameters and
applies the same averaged gradient, N ranks with batch b train exactly like
one rank with batch N*b (up to floating-point summation order).
The model and its data come from the family ``model.kind`` (:mod:`hpctrain.models`);
the trainer knows them only through that interface.
"""

from __future__ import annotations

import math

import numpy as np

from .ckpt.manager import CheckpointManager, check_writable
from .ckpt.signals import StopSignal
from .ckpt.state import fresh_rng
from .device import make_device
from .errors import ConfigError, DataError
from .comm import make_allreduce
from .comm.buckets import layout_signature, plan_buckets
from .comm.collectives import Collectives
from .comm.grid import align_auto, check_same_reduction, make_grid
from .comm.compression import GradientCompression
from .comm.staging import Staging
from .comm.zero import param_gatherer, traffic_halves
from .comm.zero_grads import make_reducer, place_gradients, plan_zero
from .data.sampler import shard_range
from .faults import Faults
from .guard import agree
from .log import Log, Metrics, Timers
from .models import family
from .numguard import NumericGuard
from .optim import LRSchedule, make_optimizer, peak_lr
from .progress import Progress
from .watchdog import Watchdog


class Trainer:
    """Everything a run needs, built collectively over ``world`` (all ranks construct it)."""

    def __init__(self, cfg, world, log: Log | None = None, stop_signal: StopSignal | None = None):
        """``stop_signal``: an already installed :class:`StopSignal` (the CLI installs one
        before anything else, so a signal during start-up is not fatal); by default
        run() installs its own for its duration."""
        self.cfg, self.world = cfg, world
        self.log = log or Log(world.is_root)
        # every start-up collective is watched (at 10x the limit: start-up includes local work such
        # as opening the data), so a rank that stops before training also ends the job, with a report
        self.watchdog = Watchdog(world.comm, cfg.dist.comm_timeout, self.log)  # collective (a Dup)
        self.faults = Faults(world.rank)
        self.progress = Progress(world.is_root)  # for a supervising launcher (HPCTRAIN_LAUNCH_PROGRESS)
        self.progress.mark("start", 0)
        self.watchdog.start()
        try:
            self._start_up(cfg, world)
        finally:
            self.watchdog.stop()  # run() starts it again
        self._own_signal = stop_signal is None
        self.stop_signal = stop_signal or StopSignal()

    def _start_up(self, cfg, world):
        """Everything __init__ builds, its collectives each in a watched region."""
        wd = self.watchdog
        self.faults.at_start_up()
        with wd.watch("start-up", "checking the data and the bucket layout on every rank", slack=10):
            # Set-up checks may fail on some ranks only (a file missing on one node):
            # agree() makes every rank raise the same error instead of hanging.
            agree(world, self._build)
            # Ranks reading different files (node-local copies that differ) would
            # train on garbage or mismatch in Bcast; compare what each rank sees.
            seen = world.comm.allgather(self.data.signature)
            dp = self.dp
            agree(world, _check_same_data, seen, cfg.data.train)
            # Buckets reduced in a different order or size on some rank would pair
            # collectives wrongly and hang: compare the layouts first.
            layouts = world.comm.allgather(layout_signature(self.buckets, self.device.dtype))
            agree(world, check_same_layout, layouts)
            if self.grid.tensor is not None:
                placed = world.comm.allgather(tuple(node for node, _ in dp.where))
                agree(world, check_same_reduction, placed, cfg.dist.allreduce)
        with wd.watch("start-up", f"all-reduce set-up (dist.allreduce={cfg.dist.allreduce})", slack=10):
            # strategies may run collectives while being built (auto measures), so
            # only once every rank is known to have built everything else
            self.allreduce = make_allreduce(cfg.dist.allreduce, dp, self.device, self.staging,
                                            inner=cfg.dist.hierarchical_inner, cache_path=cfg.dist.auto_cache,
                                            log=self.log)
            align_auto(self.grid, self.allreduce)
            place_gradients(self.allreduce, self.model, self.grad_slots, self.device)
            self.compression = None
            if cfg.dist.compress != "none":
                self.compression = agree(world, GradientCompression, cfg.dist.compress, cfg.dist.compress_scope, dp,
                                         self.staging, self.allreduce, self.buckets, self.model.flat, cfg.train.seed,
                                         self.log, cfg.dist.compress_start_step,
                                         cfg.optim.beta1 if cfg.dist.compress_momentum else 0.0,
                                         keep_undo=cfg.guard.nonfinite == "skip",
                                         matrix_parts=getattr(self.model, "matrix_parts", None))
            self.param_gather = None  # ZeRO-1's parameter all-gathers: the main thread's, on a duplicate comm
            if self.shards is not None:
                self.param_gather = param_gatherer(cfg.dist.allreduce, self.allreduce, dp, self.device,
                                                   Staging(self.device, cfg.dist.cuda_aware_mpi),
                                                   cfg.dist.hierarchical_inner)
        self.guard = NumericGuard(cfg.guard, self.log)
        self.comm = make_reducer(self.allreduce, self.model.flat.grad, self.buckets, self.device, self.shards,
                                 self.grad_slots, cfg.train.grad_accum_steps, overlap=cfg.dist.overlap,
                                 compression=self.compression, check_finite=cfg.guard.check_grads)
        self._bucket_names = [f"bucket {b.index + 1} of {len(self.buckets)}, "
                              f"{b.size * self.device.dtype.itemsize / 1e6:.2f} MB" for b in self.buckets]
        with wd.watch("start-up", "broadcast of the initial weights", slack=10):
            # data parallelism starts from identical weights: its rank 0's (under tensor parallelism
            # each data group holds one tensor rank's pieces)
            self.collectives = Collectives(dp, self.device, self.staging)
            self.collectives.Bcast(self.model.flat.data, root=0)
        with wd.watch("start-up", "GEMM peak for MFU", slack=10):
            self.peak_flops = None  # FLOP/s over all ranks; None: MFU not reported
            if self.model.flops_per_row:
                from .mfu import world_peak_flops

                self.peak_flops = world_peak_flops(world, self.device)
        with wd.watch("start-up", "trace clock and checkpoint directory", slack=10):
            # waiting at each phase end serialises the GPU: only when asked (or tracing, below)
            self.timers = Timers(sync=self.device.synchronize if cfg.train.sync_phases else None)
            self.tracer = None  # hpctrain.trace.Tracer when train.trace is set: spans per phase, layer, bucket
            if cfg.train.trace:
                from .trace import TracedTimers, Tracer

                self.tracer = Tracer(cfg.train.trace, world, sync=self.device.synchronize)
                self.timers = TracedTimers(self.tracer, sync=self.device.synchronize)
                self.model.tracer = self.comm.tracer = self.tracer
                self.comm.trace_args = {"strategy": cfg.dist.allreduce, "compress": cfg.dist.compress}
            self.step = 0
            # per-rank generator for anything stochastic per rank (saved under /rng)
            self.rng = fresh_rng(cfg.train.seed, world.rank)
            self.checkpoints = CheckpointManager(cfg, world, self.log)
        with self.watchdog.watch("checkpoint load", "resume", slack=10):
            self.checkpoints.resume(self)  # may restore parameters, optimizer state, step and RNG
        self.metrics.begin(resumed=self.checkpoints.saved_path is not None)
        self.progress.mark("ready", self.step)

    def _build(self):
        cfg, world = self.cfg, self.world
        # tensor groups of dist.tensor_parallel ranks split the model; data groups across them
        # average gradients: everything data-parallel below runs over self.dp
        self.grid = make_grid(world, cfg.dist.tensor_parallel)
        self.dp = dp = self.grid.data
        self.device = make_device(cfg.train.device, cfg.train.dtype, world, cfg.train.gemm)
        self.op_times = None
        if cfg.train.op_times:
            from .op_times import OpTimes

            self.op_times = OpTimes(self.device)  # wraps the device's kernel table
        models = family(cfg.model.kind)
        self.data = models.open_data(cfg, dp, self.device)   # tensor ranks of a data group read the same rows
        self.sampler, self.reader = self.data.sampler, self.data.reader
        self.tensor = None  # the TensorGroup the model's split layers all-reduce over
        if self.grid.tensor is not None:
            from .nn.tensor_parallel import TensorGroup

            self.tensor = TensorGroup(self.grid.tensor, self.device, Staging(self.device, cfg.dist.cuda_aware_mpi))
        self.model = models.build(cfg, self.device, self.data, tensor=self.tensor)
        self.model.init(cfg.train.seed)
        self.faults.check_inputs(self.model.input_dtype)
        peak = peak_lr(cfg.optim, cfg.train.global_batch)
        self.schedule = LRSchedule(cfg.optim, peak, cfg.train.steps)
        self.staging = Staging(self.device, cfg.dist.cuda_aware_mpi)
        self.buckets = plan_buckets(self.model.flat, self.device.dtype.itemsize, cfg.dist.bucket_mb,
                                    cfg.dist.first_bucket_mb)
        # ZeRO: this rank's chunk of every bucket; ZeRO-2 also the slots the gradients live in
        self.shards, self.grad_slots = plan_zero(cfg.dist.zero, cfg.dist, self.buckets, self.model, self.device,
                                                 dp)
        self.optimizer = make_optimizer(self.device, self.model.flat, cfg.optim, self.model.no_decay, self.shards,
                                        self.grad_slots and self.grad_slots.owned,
                                        cfg.dist.compress_start_step if cfg.dist.compress_momentum else 0)
        k = cfg.train.grad_accum_steps
        if cfg.train.exact_shares and self.sampler.batch % k:
            raise ConfigError(f"train.grad_accum_steps={k} does not divide the per-rank batch "
                              f"{self.sampler.batch} (global {cfg.train.global_batch} / {dp.size} data-parallel "
                              f"ranks); "
                              f"or set train.exact_shares = false to let micro-batches differ by one row")
        if self.sampler.batch < k:
            raise ConfigError(f"train.grad_accum_steps={k} exceeds this rank's {self.sampler.batch} rows per step "
                              f"(global {cfg.train.global_batch} over {dp.size} data-parallel ranks); lower it")
        # Shares (and micro-batches) that differ: every prediction's loss gets the same weight,
        # size k / (G predictions per row), instead of 1 / (the rows of its micro-batch), so the
        # sum over ranks scaled by 1 / (size k) is the whole batch's mean. Even shares keep 1/B.
        self.uneven = not self.sampler.even or self.sampler.batch % k != 0
        if self.uneven:
            self.model.loss.row_weight = (dp.size * k) / (cfg.train.global_batch * self.model.targets_per_row)
        if cfg.optim.schedule == "cosine" and cfg.optim.min_lr > peak:
            raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} exceeds the peak lr {peak:g} "
                              f"(after the linear scaling rule); lower optim.min_lr")
        check_writable(cfg.checkpoint.dir)
        if cfg.train.trace:
            from .trace import make_trace_dir

            make_trace_dir(cfg.train.trace)
        # opened here so an unwritable path is an agreed user error, not an abort; emptied
        # after the resume unless a checkpoint was loaded (a resumed run appends to its metrics)
        self.metrics = Metrics(cfg.train.metrics, world.is_root)

    # ---- one step ----------------------------------------------------------------
    def train_step(self) -> tuple[float, int]:
        """Run global step ``self.step`` whole (update included, no verdict); returns this rank's
        (loss_sum, correct). The run loop uses :meth:`compute_step` and judges first."""
        loss_sum, correct, _ = self.compute_step(update=True)
        self.step += 1
        return loss_sum, correct

    def compute_step(self, update: bool) -> tuple[float, int, tuple[bool, bool]]:
        """Forward, backward and all-reduce of global step ``self.step`` on this rank, and with
        ``update`` the optimizer step too; returns (loss_sum, correct, (loss is not finite,
        averaged gradient is not finite)).

        With k = grad_accum_steps, the rank's rows are k micro-batches whose
        gradients add up locally; only the last backward feeds the buckets (ZeRO-2:
        every backward, hpctrain.comm.zero_grads), and the sum over ranks and
        micro-batches is scaled once by 1 / (size k).
        Where shares differ, each loss is weighted so that the result is still
        the mean over the whole global batch (see ``_build``).
        """
        t, k, wd = self.timers, self.cfg.train.grad_accum_steps, self.watchdog
        with t("data"):
            x_all, y_all = self.reader.batch(self.step)
            x_all = self.faults.before_step(self.step, x_all)
        self.comm.start(scale=1.0 / (self.dp.size * k), step=self.step)
        loss_sum, correct = 0.0, 0
        for micro in range(k):
            last = micro == k - 1
            with t("data"):
                part = slice(*shard_range(len(y_all), micro, k))  # k equal parts, or differing by one row
                x = self.device.upload(x_all[part], "x", self.model.input_dtype)
                y = self.device.upload(y_all[part], "y", np.int64)
            with t("forward"):
                ls, c = self.model.forward(x, y)
                loss_sum, correct = loss_sum + ls, correct + c
            with t("backward"):  # ZeRO-2 reduces every micro-batch (comm.every_micro): it overwrites
                fresh = micro == 0 or self.comm.every_micro
                self.model.backward(accumulate=not fresh, ready=self.comm.mark_ready if last or
                                    self.comm.every_micro else None, claim=self.comm.claim)
        # the optimizer waits for each bucket in turn and updates just its slice
        # ("allreduce" is the exposed wait; the overlapped part hides in backward)
        if update:
            self.optimizer.begin_step(self.step)
        lr = self.schedule.lr(self.step)
        for bucket, name in zip(self.buckets, self._bucket_names):
            with t("allreduce"), wd.watch("gradient all-reduce", f"{name}, step {self.step}", self.step):
                self.comm.wait(bucket)
            if update:
                self._update(bucket, name, lr)
        return loss_sum, correct, (not math.isfinite(loss_sum), self.comm.nonfinite)

    def apply_update(self) -> None:
        """The optimizer step of a judged step whose buckets are all reduced (deferred guard policies)."""
        self.optimizer.begin_step(self.step)
        lr = self.schedule.lr(self.step)
        for bucket, name in zip(self.buckets, self._bucket_names):
            self._update(bucket, name, lr)

    def _update(self, bucket, name, lr) -> None:
        """The optimizer on ``bucket`` (ZeRO-1: on this rank's chunk, then the bucket's parameters
        all-gathered, while the communication thread reduce-scatters the next buckets)."""
        if self.shards is None:
            with self.timers("optimizer"):
                self.optimizer.update(lr, bucket.lo, bucket.hi)
            return
        lo, hi, _ = self.shards.pieces[bucket.index]
        with self.timers("optimizer"):
            self.optimizer.update(lr, lo, hi)
        with self.timers("allgather"), self.watchdog.watch("parameter all-gather", f"{name}, step {self.step}",
                                                            self.step):
            self.param_gather.allgather(self.model.flat.data[bucket.lo:bucket.hi])

    def _compression_metrics(self) -> dict:
        c = self.compression
        if c is None:  # the same measure as a compressor's: 2 (p-1)/p of the buckets, per rank
            halves = traffic_halves(self.cfg.dist.zero, getattr(self.allreduce, "native_halves", False),
                                    self.cfg.train.grad_accum_steps)
            dense = halves * (self.dp.size - 1) * self.comm.bytes // self.dp.size
            return {"bytes_sent": dense, "bytes_dense": dense}
        return {"compress": self.cfg.dist.compress, "compress_scope": self.cfg.dist.compress_scope,
                "bytes_sent": c.sent_bytes, "bytes_dense": c.dense_bytes, "compression_ratio": c.ratio,
                "encode_time": c.encode_s, "decode_time": c.decode_s}

    def evaluate(self, whole: bool = False) -> dict:
        """Loss, accuracy (and for byte tokens bits per byte) on the evaluation set (all of it with
        ``whole``, else the family's subset), each rank scoring its shard; forward only, no gradient
        or optimizer state touched. Collective."""
        totals = np.zeros(3)  # loss_sum, correct, predictions
        # a data group's tensor ranks score the same shard: each counts it once in the world's
        # sums below, loss and predictions alike, so the means are those of the data groups
        for x_host, y_host in self.data.eval_shard(self.dp.rank, self.dp.size, whole):
            x = self.device.upload(x_host, "eval_x", self.model.input_dtype)
            y = self.device.upload(y_host, "eval_y", np.int64)
            loss_sum, correct = self.model.forward(x, y)
            totals += (loss_sum, correct, y_host.size)
        with self.watchdog.watch("evaluation all-reduce", f"step {self.step}", self.step, 10):
            self.world.comm.Allreduce(_in_place(), totals)
        if self.op_times:
            self.op_times.pop()  # evaluation's forward passes are not part of a training step's split
        loss = float(totals[0] / totals[2])
        out = {"loss": loss, "accuracy": float(totals[1] / totals[2])}
        if self.data.bits_per_byte:
            out["bpb"] = loss / math.log(2)
        return out

    def close(self) -> None:
        """Close the data files (the run is over; the trainer is not used again)."""
        self.data.close()

    # ---- the run -------------------------------------------------------------------
    def run(self) -> dict:
        """Train to ``train.steps`` (or a stop signal); collective. See :mod:`hpctrain.loop`."""
        from .loop import run

        return run(self)


def check_same_layout(layouts):
    """Every rank must reduce the same gradient buckets in the same order."""
    if len(set(layouts)) > 1:
        detail = ", ".join(f"rank {r}: {h}" for r, h in enumerate(layouts))
        raise ConfigError(f"ranks disagree on the gradient bucket layout ({detail}); every rank must build "
                          f"the same model with the same dist.bucket_mb and train.dtype, or the all-reduce "
                          f"would deadlock")


def _check_same_data(seen, path):
    if len(set(seen)) > 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
        raise DataError(f"ranks see different datasets at {path!r} ({detail}); "
                        f"every rank must read the same file (check node-local copies)")


def _in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE

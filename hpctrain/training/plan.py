"""The plan: what runs where, decided once from the configuration and the world.

A :class:`Plan` holds the process grid (data x tensor x pipeline) and this rank's groups, the
device and precision, the gradient buckets, the ZeRO shares and slots, the all-reduce strategy and
ZeRO-1's parameter gatherer. Its layout is fixed at start-up; the objects it holds (communicators,
ZeRO-3's parameter slots, the tensor group's counters) carry their own per-step state. Built in
three stages, because the buckets follow the model's flat parameter layout and an all-reduce
strategy may measure while it is built:

    plan = place(cfg, world)      grid, groups, device, staging   (collective: communicator splits)
    plan.divide(model)            buckets, ZeRO shares and slots  (local)
    plan.connect(log, watchdog)   all-reduce strategy, gatherer   (collective; only once every rank
                                                                    is known to have built the rest)

:func:`on_paper` makes the same plan without communicators or memory: what ``info --config``
prints, and the bytes :func:`planned_memory` counts, for a configuration at any world size.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field

from ..comm import make_allreduce
from ..comm.buckets import plan_buckets
from ..comm.grid import Grid, align_auto, check_divides, groups, make_grid, place_of
from ..comm.staging import Staging
from ..comm.zero import param_gatherer, plan_zero
from ..device import make_device, on_device
from ..observe import memory
from ..precision import policy


@dataclass
class Plan:
    """What runs where (see the module docstring). ``grid.data`` is the data-parallel group every
    gradient reduction runs over; ``tensor`` the :class:`~hpctrain.nn.tensor_parallel.TensorGroup`
    the model's split layers all-reduce over (None without tensor parallelism)."""

    cfg: object
    world: object
    grid: Grid
    device: object
    staging: Staging | None
    tensor: object = None
    buckets: list = field(default_factory=list)
    shards: object = None                  # ZeRO >= 1: this rank's chunk of every bucket
    grad_slots: object = None              # ZeRO-2: the reused gradient slots and this rank's chunks
    param_slots: object = None             # ZeRO-3: the reused parameter slots and this rank's chunks
    allreduce: object = None               # the strategy of dist.allreduce, after connect()
    param_gather: object = None            # ZeRO-1's parameter all-gathers (a duplicate communicator)
    precision: object = None               # the hpctrain.precision.Precision of train.precision
    stage_counts: tuple = ()               # blocks per pipeline stage, after divide()
    by_layers: bool = False                # the buckets are the model's layer units (dist.bucket_split)

    def __post_init__(self):
        if self.precision is None:
            self.precision = policy(self.cfg.train.precision, self.cfg.train.dtype, self.cfg.dist.reduce_dtype)
        # the device the model computes on: ``device`` itself, or a MixedDevice over it (bf16, fp16);
        # the flat masters, the optimizer and the communication use ``device``
        self.model_device = on_device(self.device, self.precision)

    @property
    def pipeline(self) -> int:
        """Pipeline stages (``dist.pipeline_parallel``)."""
        return self.grid.p

    @property
    def in_flight(self) -> int:
        """The most micro-batches whose activations this rank holds at once: one, or on a pipeline
        stage what its schedule keeps (GPipe m, 1F1B min(p - stage, m))."""
        if self.pipeline == 1:
            return 1
        from .pipeline import in_flight
        from .schedules import stage_schedule

        return in_flight(stage_schedule(self.cfg.dist.pipeline_schedule, self.grid.stage, self.pipeline,
                                        self.micro_batches))

    @property
    def dp(self):
        """The data-parallel group (the world itself without tensor parallelism)."""
        return self.grid.data

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step (``train.grad_accum_steps``)."""
        return self.cfg.train.grad_accum_steps

    def divide(self, model) -> None:
        """Buckets over ``model``'s flat parameters, and the ZeRO shares (ZeRO-2: ``model``'s gradients
        move into the slots). Local."""
        d = self.cfg.dist
        self.stage_counts = getattr(getattr(model, "span", None), "counts", ())
        # a pipeline's tied table is summed over the embedding group once its data group has averaged
        # it: a bucket of its own, so that both stages' buckets (and ZeRO chunks) of it are alike
        alone = ("wte",) if self.pipeline > 1 and any(s.name == "wte" for s in model.flat.slots) else ()
        self.by_layers = d.bucket_split == "layers" or d.bucket_split == "auto" and d.zero == 3
        self.buckets = plan_buckets(model.flat, self.device.dtype.itemsize, d.bucket_mb, d.first_bucket_mb, alone,
                                    model.layer_units if self.by_layers else None)
        self.shards, self.grad_slots, self.param_slots = plan_zero(d.zero, d, self.buckets, model, self.device,
                                                                   self.dp)

    def connect(self, log, watchdog=None) -> None:
        """The all-reduce strategy (``auto`` measures here) and ZeRO-1's parameter gatherer (ZeRO-3's
        gathers watched by ``watchdog``). Collective over the data group (and the tensor group, which
        aligns ``auto``'s choices)."""
        d = self.cfg.dist
        self.allreduce = make_allreduce(d.allreduce, self.dp, self.device, self.staging, inner=d.hierarchical_inner,
                                        cache_path=d.auto_cache, log=log)
        align_auto(self.grid, self.allreduce)
        if self.shards is not None:
            self.param_gather = param_gatherer(d.allreduce, self.allreduce, self.dp, self.device,
                                               Staging(self.device, d.cuda_aware_mpi), d.hierarchical_inner)
        if self.param_slots is not None:   # ZeRO-3 gathers before use, on its own thread, with that gatherer
            self.param_slots.connect(self.param_gather, watchdog)

    def tied_share(self):
        """On a pipeline's first or last stage: (its pipeline group's first rank, the [lo, hi) of the tied
        table ``wte`` this rank updates, counted from the table's start); None elsewhere. Under ZeRO
        both stages' ranks must own the same part (the trainer checks: they sum it with each other)."""
        tied = next((b for b in self.buckets if b.slots == ("wte",)), None)
        if tied is None or self.grid.embedding is None:
            return None
        lo, hi = (tied.lo, tied.hi) if self.shards is None else self.shards.pieces[tied.index][:2]
        return self.world.rank % (self.world.size // self.pipeline), (lo - tied.lo, hi - tied.lo)   # local

    def bucket_names(self) -> list[str]:
        """'bucket 2 of 5, 4.19 MB' per bucket: where the watchdog says a collective waits."""
        item = self.device.dtype.itemsize
        return [f"bucket {b.index + 1} of {len(self.buckets)}, {b.size * item / 1e6:.2f} MB" for b in self.buckets]

    def describe(self) -> str:
        """The plan in a few lines (``info --config``)."""
        cfg, d, t = self.cfg, self.cfg.dist, self.grid.t
        size = self.dp.size * t * self.pipeline
        lines = [f"plan: {size} rank(s) = data {self.dp.size} x tensor {t} x pipeline {self.pipeline}"]
        if t > 1 or self.pipeline > 1:
            tensor, data, pipeline = groups(size, t, self.pipeline)
            lines.append("  " + (f"tensor groups {' '.join(map(str, tensor))}; " if t > 1 else "")
                         + f"data groups {' '.join(map(str, data))}"
                         + (f"; pipeline groups {' '.join(map(str, pipeline))}" if self.pipeline > 1 else ""))
        if self.pipeline > 1:
            from .schedules import bubble_fraction
            from .schedules import describe as describe_schedule

            counts = list(self.stage_counts)
            lines.append(f"  pipeline: blocks per stage {counts}"
                         f"{'' if d.pipeline_stages else f' (balanced by {d.pipeline_balance})'}, schedule {d.pipeline_schedule}, "
                         f"{self.micro_batches} micro-batch(es) per step: each stage idles "
                         f"{bubble_fraction(self.pipeline, self.micro_batches):.0%} of a step "
                         f"((p - 1) / (m + p - 1))"
                         + (f"; fewer micro-batches than stages: 1f1b holds as many as gpipe (m), raise "
                            f"train.grad_accum_steps to {self.pipeline} or more" if self.micro_batches < self.pipeline
                            else ""))
            lines += ["  " + line for line in describe_schedule(d.pipeline_schedule, self.pipeline, self.micro_batches,
                                                                 compute_only=True).splitlines()]
        reduced = cfg.train.dtype if d.compress == "none" else f"compressed by {d.compress}"
        lines.append(f"  device {self.device.name}; {self.precision.describe()}, "
                     f"gradients reduced {reduced}; {self.micro_batches} micro-batch(es) per step")
        item = self.device.dtype.itemsize
        sizes = [b.size * item / 1e6 for b in self.buckets]
        lines.append(f"  {len(self.buckets)} gradient bucket(s) by {'layers' if self.by_layers else 'size'}, "
                     f"{min(sizes, default=0):,.2f}-{max(sizes, default=0):,.2f} MB, reduced over the data group by dist.allreduce = {d.allreduce}"
                     + (" (measured at start-up)" if d.allreduce == "auto" else "")
                     + f", overlap {'on' if d.overlap else 'off'}")
        zero = {0: "zero 0: every rank holds all optimizer state and gradients",
                1: f"zero 1: optimizer state in 1/{self.dp.size} shares, parameters all-gathered per bucket",
                2: f"zero 2: zero 1 plus gradients in {self.grad_slots.count if self.grad_slots else 0} "
                   f"reused bucket slot(s) and 1/{self.dp.size} shares",
                3: f"zero 3: zero 2 plus parameters in 1/{self.dp.size} shares, each layer part's gathered "
                   f"before it runs into {self.param_slots.layout.rotating if self.param_slots else 0} slot(s) "
                   f"taken in turn ({len(self.param_slots.layout.own) if self.param_slots else 0} more for "
                   f"the vectors and the token table)"}[d.zero]
        lines.append(f"  {zero}; compression {d.compress}"
                     + (f" (scope {d.compress_scope})" if d.compress != "none" else ""))
        return "\n".join(lines)


def place(cfg, world, device=None) -> Plan:
    """The grid, this rank's groups, the device (``device``, or the one ``train.device`` names) and
    its staging. Collective over ``world.comm`` (the grid's splits) when t > 1."""
    from ..nn.tensor_parallel import TensorGroup

    grid = make_grid(world, cfg.dist.tensor_parallel, cfg.dist.pipeline_parallel)
    device = device or make_device(cfg.train.device, cfg.train.dtype, world, cfg.train.gemm, cfg.model.attention)
    tensor = None
    if grid.tensor is not None:
        tensor = TensorGroup(grid.tensor, device, Staging(device, cfg.dist.cuda_aware_mpi))
    return Plan(cfg, world, grid, device, Staging(device, cfg.dist.cuda_aware_mpi), tensor)


def on_paper(cfg, world) -> Plan:
    """The plan of ``cfg`` for this rank of ``world`` without communicators or memory: the groups as
    rank and size only, an :class:`~hpctrain.observe.memory.Unallocated` device like the one
    ``train.device`` would make. Local; :meth:`Plan.divide` works on it, :meth:`Plan.connect` not."""
    like = cfg.train.device
    if like == "auto":  # as make_device decides it
        from ..device import cuda_status, simulated

        like = "cuda" if not simulated() and cuda_status()[0] else "cpu"
    t, p = cfg.dist.tensor_parallel, cfg.dist.pipeline_parallel
    check_divides(world.size, t, p)
    stage, data_rank, tensor_rank = place_of(world.rank, world.size, t, p)
    data = dataclasses.replace(world, comm=None, rank=data_rank, size=world.size // (t * p))
    tensor = types.SimpleNamespace(size=t, rank=tensor_rank) if t > 1 else None
    pipeline = types.SimpleNamespace(size=p, rank=stage) if p > 1 else None
    grid = Grid(t, tensor, data, p, pipeline)
    return Plan(cfg, world, grid, memory.Unallocated(cfg.train.dtype, like=like, attention=cfg.model.attention),
                None, tensor)


def planned_memory(cfg, world) -> dict:
    """What :func:`~hpctrain.observe.memory.computed` reports for ``cfg`` on this rank of ``world``,
    without training or allocating: the model, buckets, ZeRO shares and slots and the optimizer
    built on the :func:`on_paper` plan (the data file is opened for its shapes). Local."""
    return paper_run(cfg, world)[1]


def paper_run(cfg, world) -> tuple[Plan, dict]:
    """(the :func:`on_paper` plan, divided over the model ``cfg`` builds; its bytes per rank)."""
    from ..models import family
    from ..optim import make_optimizer

    plan = on_paper(cfg, world)
    models = family(cfg.model.kind)
    data = models.open_data(cfg, plan.dp, plan.device)
    try:
        model = models.build(cfg, plan.model_device, data, tensor=plan.tensor, stage=plan.grid.stage)
        plan.divide(model)
        optimizer = make_optimizer(plan.device, model.flat, cfg.optim, model.no_decay, plan.shards,
                                   params=plan.param_slots and plan.param_slots.owned)
        return plan, memory_of(plan, model, optimizer, data.sampler)
    finally:
        data.close()


def memory_of(plan, model, optimizer, sampler) -> dict:
    """The bytes :func:`~hpctrain.observe.memory.computed` counts on this rank for ``model`` and
    ``optimizer`` as ``plan`` divides them, with activations of this rank's largest micro-batch, and
    a checkpoint's (``"checkpoint"``: :func:`~hpctrain.ckpt.ownership.checkpoint_bytes`)."""
    from ..ckpt.ownership import checkpoint_bytes

    rows = -(-sampler.batch // plan.micro_batches)
    out = memory.computed(model, optimizer, plan.device, rows, plan.grad_slots, plan.in_flight, plan.param_slots,
                          offload=plan.cfg.dist.offload != "none")
    if getattr(model.flat, "slots", None) is not None:   # (a stand-in model of the loop's tests has none)
        out["checkpoint"] = checkpoint_bytes(model, optimizer, plan, plan.cfg.checkpoint.async_save)
    return out

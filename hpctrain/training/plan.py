"""The plan: what runs where, decided once from the configuration and the world.

A :class:`Plan` is pure data plus the communicators: the process grid (data x tensor; the
pipeline axis is there, of size 1, for the schedules to come), this rank's groups, the device
and its compute dtype, the gradient buckets, the ZeRO shares and gradient slots, the all-reduce
strategy and ZeRO-1's parameter gatherer. The trainer, the step and the checkpoints read it;
nothing in it changes after start-up. Built in three stages, because the buckets follow the
model's flat parameter layout and an all-reduce strategy may measure while it is built:

    plan = place(cfg, world)      grid, groups, device, staging   (collective: communicator splits)
    plan.divide(model)            buckets, ZeRO shares and slots  (local)
    plan.connect(log)             all-reduce strategy, gatherer   (collective; only once every rank
                                                                    is known to have built the rest)

:func:`on_paper` makes the same plan without communicators or memory (this rank's place in the
grid as numbers, an :class:`~hpctrain.observe.memory.Unallocated` device): what ``info --config``
prints, and the bytes :func:`planned_memory` counts, for a configuration at any world size.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field

from ..comm import make_allreduce
from ..comm.buckets import plan_buckets
from ..comm.grid import Grid, align_auto, check_divides, groups, make_grid
from ..comm.staging import Staging
from ..comm.zero import param_gatherer
from ..comm.zero_grads import plan_zero
from ..device import make_device
from ..observe import memory
from ..precision import on_device, policy


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
    pipeline: int = 1                      # pipeline stages: one (the axis is reserved)
    buckets: list = field(default_factory=list)
    shards: object = None                  # ZeRO >= 1: this rank's chunk of every bucket
    grad_slots: object = None              # ZeRO-2: the reused gradient slots and this rank's chunks
    allreduce: object = None               # the strategy of dist.allreduce, after connect()
    param_gather: object = None            # ZeRO-1's parameter all-gathers (a duplicate communicator)
    precision: object = None               # the hpctrain.precision.Precision of train.precision

    def __post_init__(self):
        if self.precision is None:
            self.precision = policy(self.cfg.train.precision, self.cfg.train.dtype)
        # the device the model computes on: ``device`` itself, or a MixedDevice over it (bf16, fp16);
        # the flat masters, the optimizer and the communication use ``device``
        self.model_device = on_device(self.device, self.precision)

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
        self.buckets = plan_buckets(model.flat, self.device.dtype.itemsize, d.bucket_mb, d.first_bucket_mb)
        self.shards, self.grad_slots = plan_zero(d.zero, d, self.buckets, model, self.device, self.dp)

    def connect(self, log) -> None:
        """The all-reduce strategy (``auto`` measures here) and ZeRO-1's parameter gatherer.
        Collective over the data group (and the tensor group, which aligns ``auto``'s choices)."""
        d = self.cfg.dist
        self.allreduce = make_allreduce(d.allreduce, self.dp, self.device, self.staging, inner=d.hierarchical_inner,
                                        cache_path=d.auto_cache, log=log)
        align_auto(self.grid, self.allreduce)
        if self.shards is not None:
            self.param_gather = param_gatherer(d.allreduce, self.allreduce, self.dp, self.device,
                                               Staging(self.device, d.cuda_aware_mpi), d.hierarchical_inner)

    def bucket_names(self) -> list[str]:
        """'bucket 2 of 5, 4.19 MB' per bucket: where the watchdog says a collective waits."""
        item = self.device.dtype.itemsize
        return [f"bucket {b.index + 1} of {len(self.buckets)}, {b.size * item / 1e6:.2f} MB" for b in self.buckets]

    def describe(self) -> str:
        """The plan in a few lines (``info --config``)."""
        cfg, d, t = self.cfg, self.cfg.dist, self.grid.t
        size = self.dp.size * t * self.pipeline
        lines = [f"plan: {size} rank(s) = data {self.dp.size} x tensor {t} x pipeline {self.pipeline}"]
        if t > 1:
            tensor, data = groups(size, t)
            lines.append(f"  tensor groups {' '.join(map(str, tensor))}; data groups {' '.join(map(str, data))}")
        reduced = cfg.train.dtype if d.compress == "none" else f"compressed by {d.compress}"
        lines.append(f"  device {self.device.name}; {self.precision.describe()}, "
                     f"gradients reduced {reduced}; {self.micro_batches} micro-batch(es) per step")
        item = self.device.dtype.itemsize
        sizes = [b.size * item / 1e6 for b in self.buckets]
        lines.append(f"  {len(self.buckets)} gradient bucket(s), {min(sizes, default=0):,.2f}-{max(sizes, default=0):,.2f}"
                     f" MB, reduced over the data group by dist.allreduce = {d.allreduce}"
                     + (" (measured at start-up)" if d.allreduce == "auto" else "")
                     + f", overlap {'on' if d.overlap else 'off'}")
        zero = {0: "zero 0: every rank holds all optimizer state and gradients",
                1: f"zero 1: optimizer state in 1/{self.dp.size} shares, parameters all-gathered per bucket",
                2: f"zero 2: zero 1 plus gradients in {self.grad_slots.rotating + 1 if self.grad_slots else 0} "
                   f"reused bucket slot(s) and 1/{self.dp.size} shares"}[d.zero]
        lines.append(f"  {zero}; compression {d.compress}"
                     + (f" (scope {d.compress_scope})" if d.compress != "none" else ""))
        return "\n".join(lines)


def place(cfg, world, device=None) -> Plan:
    """The grid, this rank's groups, the device (``device``, or the one ``train.device`` names) and
    its staging. Collective over ``world.comm`` (the grid's splits) when t > 1."""
    from ..nn.tensor_parallel import TensorGroup

    grid = make_grid(world, cfg.dist.tensor_parallel)
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

        like = "cuda" if cuda_status()[0] and not simulated() else "cpu"
    t = cfg.dist.tensor_parallel
    check_divides(world.size, t)
    data = dataclasses.replace(world, comm=None, rank=world.rank // t, size=world.size // t)
    tensor = types.SimpleNamespace(size=t, rank=world.rank % t) if t > 1 else None
    return Plan(cfg, world, Grid(t, tensor, data), memory.Unallocated(cfg.train.dtype, like=like, attention=cfg.model.attention), None, tensor)


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
        model = models.build(cfg, plan.model_device, data, tensor=plan.tensor)
        plan.divide(model)
        optimizer = make_optimizer(plan.device, model.flat, cfg.optim, model.no_decay, plan.shards)
        return plan, memory_of(plan, model, optimizer, data.sampler)
    finally:
        data.close()


def memory_of(plan, model, optimizer, sampler) -> dict:
    """The bytes :func:`~hpctrain.observe.memory.computed` counts on this rank for ``model`` and
    ``optimizer`` as ``plan`` divides them, with activations of this rank's largest micro-batch."""
    rows = -(-sampler.batch // plan.micro_batches)
    return memory.computed(model, optimizer, plan.device, rows, plan.grad_slots)

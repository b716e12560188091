"""Per-rank memory: what the trainer's arrays take (computed) and the peak the process reached (measured).

Computed, per rank, in bytes: parameters and gradients (the flat buffers: every rank holds all of
them; with ``dist.zero = 2`` the gradients are the reused bucket slots and this rank's chunks, from
:mod:`hpctrain.comm.zero_grads`), optimizer state (zero 0: all of it; ``dist.zero >= 1``: this rank's
share, the packed chunks of :mod:`hpctrain.comm.zero`) and activations (what the model keeps for backward for one
micro-batch, from its ``activation_bytes(rows)``; None for a model that does not say). Measured:
the process's peak resident set (``ru_maxrss``) and, on a GPU, the device memory in use.
:func:`planned` computes the same bytes for a config without training or allocating (``info --config``).
"""

from __future__ import annotations

import dataclasses
import resource
import types

import numpy as np

from .device import CPU_OPS, CpuDevice


class Unallocated(CpuDevice):
    """A device whose arrays have the right shapes and take no memory (one zero, broadcast), for
    counting bytes; with ``like="cuda"`` it has the CUDA device's name, and its attention keeps what
    the CUDA kernels keep and refuses the head sizes they refuse (as a run on cuda would)."""

    def __init__(self, dtype="float32", like: str = "cpu"):
        super().__init__(dtype)
        if like == "cuda":
            from .kernels.attention_cuda import HS_SIZES, attention_state_shapes

            self.name = "cuda"
            self.ops = types.SimpleNamespace(**{**vars(CPU_OPS), "attention_state_shapes": attention_state_shapes,
                                                "attention_max_head_size": HS_SIZES[-1]})

    def empty(self, shape, dtype=None):
        return np.broadcast_to(np.zeros((), dtype or self.dtype), shape)

    zeros = empty


def computed(trainer) -> dict:
    """{"params", "grads", "optimizer", "activations"}: bytes on this rank (activations may be None)."""
    item = trainer.device.dtype.itemsize
    flat, opt = trainer.model.flat, trainer.optimizer
    states = len(opt.state())
    rows = -(-trainer.sampler.batch // trainer.cfg.train.grad_accum_steps)  # the largest micro-batch
    per_rows = getattr(trainer.model, "activation_bytes", None)
    slots = getattr(trainer, "grad_slots", None)  # ZeRO-2: the reused bucket slots and this rank's chunks
    grads = flat.size if slots is None else slots.size + slots.owned.size
    return {"params": flat.size * item, "grads": grads * item, "optimizer": states * opt.state_size * item,
            "activations": per_rows(rows) if per_rows is not None else None}


def planned(cfg, world) -> dict:
    """What :func:`computed` reports for ``cfg`` on this rank of ``world``, without training: the
    model, buckets, ZeRO shares and slots built on an :class:`Unallocated` device (the data file is
    opened for its shapes). Local."""
    from .comm.buckets import plan_buckets
    from .comm.zero_grads import plan_zero
    from .models import family
    from .optim import make_optimizer

    like = cfg.train.device
    if like == "auto":  # as make_device decides it
        from .device import cuda_status, simulated

        like = "cuda" if cuda_status()[0] and not simulated() else "cpu"
    dev = Unallocated(cfg.train.dtype, like=like)
    models = family(cfg.model.kind)
    t, tensor = cfg.dist.tensor_parallel, None
    if t > 1:  # this rank's place in the grid (comm.grid), without its communicators: shapes only
        from .comm.grid import check_divides

        check_divides(world.size, t)
        tensor = types.SimpleNamespace(size=t, rank=world.rank % t)
        world = dataclasses.replace(world, rank=world.rank // t, size=world.size // t)  # its data group
    data = models.open_data(cfg, world, dev)
    try:
        model = models.build(cfg, dev, data, tensor=tensor)
        buckets = plan_buckets(model.flat, dev.dtype.itemsize, cfg.dist.bucket_mb, cfg.dist.first_bucket_mb)
        shards, slots = plan_zero(cfg.dist.zero, cfg.dist, buckets, model, dev, world)
        optimizer = make_optimizer(dev, model.flat, cfg.optim, model.no_decay, shards)
        return computed(types.SimpleNamespace(device=dev, model=model, optimizer=optimizer, sampler=data.sampler,
                                              cfg=cfg, grad_slots=slots))
    finally:
        data.close()


def describe(b: dict, zero: int, size: int) -> str:
    """One start-up line: the computed bytes per rank, in MB."""
    parts = [f"parameters {b['params'] / 1e6:,.2f} MB",
             f"gradients {b['grads'] / 1e6:,.2f} MB" + (" (zero 2: bucket slots and a 1/%d share)" % size
                                                         if zero == 2 else ""),
             f"optimizer state {b['optimizer'] / 1e6:,.2f} MB" + (f" (zero {zero}: a 1/{size} share)" if zero else "")]
    if b["activations"] is not None:
        parts.append(f"activations {b['activations'] / 1e6:,.2f} MB per micro-batch")
    return "memory per rank (computed): " + ", ".join(parts)


def zero2_advice(trainer) -> str | None:
    """A warning when ``dist.zero = 2`` keeps no less gradient memory than zero 1 would (too few
    buckets for backward to reuse a slot), else None."""
    slots, flat = getattr(trainer, "grad_slots", None), trainer.model.flat
    if slots is None or slots.size + slots.owned.size < flat.size:
        return None
    item = trainer.device.dtype.itemsize
    return (f"dist.zero=2 keeps {(slots.size + slots.owned.size) * item / 1e6:,.2f} MB of gradients per rank, no "
            f"less than the {flat.size * item / 1e6:,.2f} MB of zero 1: its {len(trainer.buckets)} bucket(s) leave "
            f"backward no slot to reuse; lower dist.bucket_mb and dist.first_bucket_mb (now "
            f"{trainer.cfg.dist.bucket_mb:g} and {trainer.cfg.dist.first_bucket_mb:g}) for smaller buckets, or use "
            f"dist.zero=1")


def measured(device) -> dict:
    """{"peak_rss_mb": the process's peak resident set} and, on a GPU that says, "device_used_mb"."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    used = getattr(device, "memory_used", lambda: None)()
    if used is not None:
        out["device_used_mb"] = used / 1e6
    return out

"""Per-rank memory: what the trainer's arrays take (computed) and the peak the process reached (measured).

Computed (:func:`computed`), per rank, in bytes: parameters (the masters, plus their compute copy
under a 16-bit precision; under ZeRO-3 the gathered slots and this rank's chunks) and gradients
(the flat buffer; under ZeRO-2 the reused bucket slots and this rank's chunks,
:mod:`hpctrain.comm.zero_grads`), optimizer state (all of it, or this rank's share under
``dist.zero >= 1``; in host memory under ``dist.offload``) and activations (what the model keeps for
backward for the micro-batches a pipeline stage holds at once, from its ``activation_bytes``; None
for a model that does not say). Measured: the peak resident set (``ru_maxrss``) and, on a GPU, the
device memory in use. :func:`hpctrain.training.plan.planned_memory` computes the same bytes for a
config without training or allocating (``info --config``), on an :class:`Unallocated` device.
"""

from __future__ import annotations

import resource
import types

import numpy as np

from ..device import CPU_OPS, CpuDevice


class Unallocated(CpuDevice):
    """A device whose arrays have the right shapes and take no memory (one zero, broadcast), for
    counting bytes; with ``like="cuda"`` it has the CUDA device's name, and its attention keeps what
    the CUDA kernels keep and, under ``model.attention = flash``, refuses the head sizes the flash
    kernels refuse (as a run on cuda would; the GEMM path takes any)."""

    def __init__(self, dtype="float32", like: str = "cpu", attention: str = "auto"):
        super().__init__(dtype)
        if like == "cuda":
            from ..kernels.attention import HS_SIZES, attention_state_shapes_cuda

            self.name = "cuda"
            self.ops = types.SimpleNamespace(**{**vars(CPU_OPS), "attention_state_shapes": attention_state_shapes_cuda,
                                                "attention_saved_kind": "lse",
                                                "attention_max_head_size":
                                                    HS_SIZES[-1] if attention == "flash" else None})

    def empty(self, shape, dtype=None):
        return np.broadcast_to(np.zeros((), dtype or self.dtype), shape)

    zeros = empty


def computed(model, optimizer, device, rows: int, grad_slots=None, in_flight: int = 1, param_slots=None,
             offload: bool = False) -> dict:
    """{"params", "grads", "optimizer", "activations", "in_flight"}: bytes on this rank of ``model``'s
    flat buffers (parameters: the masters, and under a 16-bit ``train.precision`` their compute copy
    too), ``optimizer``'s state and the activations of ``in_flight`` micro-batches of ``rows`` rows
    held at once (a pipeline stage's schedule; None for a model that does not say); ``grad_slots``:
    ZeRO-2's reused bucket slots and this rank's chunks; ``param_slots``: ZeRO-3's (the gathered
    slots and this rank's chunks of the parameters); ``offload`` (``dist.offload = "optimizer"``): the
    optimizer state is in host memory, with pinned copies of the masters and gradients it updates
    (``"optimizer"`` is then 0, the device's; ``"host_state"`` the state's bytes, ``"host"`` those
    three's)."""
    item = device.dtype.itemsize
    flat = model.flat
    per_rows = getattr(model, "activation_bytes", None)
    grads = flat.size if grad_slots is None else grad_slots.size + grad_slots.owned.size
    params = flat.size * item if param_slots is None else _nbytes(param_slots.buffer) + _nbytes(param_slots.owned)
    compute = getattr(flat, "compute", None)
    if compute is not None and compute is not getattr(flat, "data", None):   # 16-bit: masters + compute copy
        # (ZeRO-3's pool is both, in the compute dtype: counted above)
        params += flat.size * np.dtype(compute.dtype).itemsize
    state = (len(optimizer.state()) + getattr(optimizer, "work_arrays", 0)) * optimizer.state_size * item
    return {"params": params, "grads": grads * item,
            # the saved state, and the arrays an optimizer keeps beside it (LAMB's direction)
            "optimizer": 0 if offload else state, "offload": offload,
            "host_state": state if offload else 0,
            "host": state + 2 * optimizer.state_size * item if offload else 0,
            "activations": None if per_rows is None else per_rows(rows) if in_flight == 1 else per_rows(rows, in_flight),
            "in_flight": in_flight}


def _nbytes(a) -> int:
    return a.size * np.dtype(a.dtype).itemsize


def describe(b: dict, zero: int, size: int) -> str:
    """One start-up line: the computed bytes per rank, in MB."""
    parts = [f"parameters {b['params'] / 1e6:,.2f} MB" + (" (zero 3: bucket slots and a 1/%d share)" % size
                                                           if zero == 3 else ""),
             f"gradients {b['grads'] / 1e6:,.2f} MB" + (" (zero %d: bucket slots and a 1/%d share)" % (zero, size)
                                                         if zero >= 2 else ""),
             (f"optimizer state {b['optimizer'] / 1e6:,.2f} MB" if not b.get("offload") else
              f"optimizer state 0 MB (dist.offload: {b['host_state'] / 1e6:,.2f} MB in host memory, "
              f"{b['host'] / 1e6:,.2f} MB with the masters and gradients it updates)")
             + (f" (zero {zero}: a 1/{size} share)" if zero else "")]
    if b["activations"] is not None:
        held = b.get("in_flight", 1)
        parts.append(f"activations {b['activations'] / 1e6:,.2f} MB per micro-batch" if held == 1 else
                     f"activations {b['activations'] / 1e6:,.2f} MB ({held} micro-batches in flight on this "
                     f"pipeline stage)")
    line = "memory per rank (computed): " + ", ".join(parts)
    c = b.get("checkpoint")
    if c is not None:
        line += (f"; a checkpoint: this rank writes {c['writes'] / 1e6:,.2f} MB of {c['file'] / 1e6:,.2f} MB, "
                 f"holding {c['save_host'] / 1e6:,.2f} MB more on the host "
                 f"{'for its background saves (kept between them)' if c.get('kept') else 'while it saves'}; "
                 f"a load here reads "
                 f"{c['reads'] / 1e6:,.2f} MB ({c['load_host'] / 1e6:,.2f} MB on the host while it loads)")
    return line


def zero2_advice(plan, flat) -> str | None:
    """A warning when ``dist.zero = 2`` keeps no less gradient memory than zero 1 would (too few
    buckets for backward to reuse a slot), else None. ``plan``: a
    :class:`~hpctrain.training.plan.Plan`; ``flat``: the model's flat parameters."""
    return _slot_advice(plan, flat, plan.grad_slots, 2, "gradients", "backward", "for smaller buckets")


def zero3_advice(plan, flat) -> str | None:
    """A warning when ``dist.zero = 3`` keeps no less parameter memory than zero 2 would (buckets so
    large that the gathered slots hold the whole model), else None."""
    return _slot_advice(plan, flat, getattr(plan, "param_slots", None), 3, "parameters", "forward",
                        "to about one block's parameters or less")


def _slot_advice(plan, flat, slots, zero: int, what: str, reuser: str, how: str) -> str | None:
    """ZeRO-``zero``'s warning that its ``slots`` (of ``what``) keep no less than the stage below."""
    if slots is None:
        return None
    d = plan.cfg.dist
    held = _nbytes(slots.buffer) + _nbytes(slots.owned)
    # the stage below keeps the whole model's: its masters (and under a 16-bit precision, ZeRO-3's
    # stage below also keeps every parameter's compute copy)
    below = flat.size * plan.device.dtype.itemsize
    precision = getattr(plan, "precision", None)
    if zero == 3 and precision is not None and precision.mixed:
        below += flat.size * np.dtype(precision.compute).itemsize
    if held < below:
        return None
    if getattr(plan, "by_layers", False):   # a bucket per layer unit: only a larger model has slots to reuse
        return (f"dist.zero={zero} keeps {held / 1e6:,.2f} MB of {what} per rank, "
                f"no less than the {below / 1e6:,.2f} MB of zero {zero - 1}: its {len(plan.buckets)} "
                f"layer bucket(s) are too few for the reused slots and shares to hold less than the whole model; "
                + ("use dist.bucket_split = size with smaller dist.bucket_mb, or " if zero == 2 else "use ")
                + f"dist.zero={zero - 1}")
    return (f"dist.zero={zero} keeps {held / 1e6:,.2f} MB of {what} per rank, no "
            f"less than the {below / 1e6:,.2f} MB of zero {zero - 1}: its {len(plan.buckets)} bucket(s) "
            f"leave {reuser} no slot to reuse; lower dist.bucket_mb and dist.first_bucket_mb (now "
            f"{d.bucket_mb:g} and {d.first_bucket_mb:g}) {how}, or use dist.zero={zero - 1}")


def measured(device) -> dict:
    """{"peak_rss_mb": the process's peak resident set} and, on a GPU that says, "device_used_mb"."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    used = getattr(device, "memory_used", lambda: None)()
    if used is not None:
        out["device_used_mb"] = used / 1e6
    return out

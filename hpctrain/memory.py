"""Per-rank memory: what the trainer's arrays take (computed) and the peak the process reached (measured).

Computed, per rank, in bytes: parameters and gradients (the flat buffers: every rank holds all of
them), optimizer state (zero 0: all of it; ``dist.zero = 1``: this rank's share, the packed chunks
of :mod:`hpctrain.comm.zero`) and activations (what the model keeps for backward for one
micro-batch, from its ``activation_bytes(rows)``; None for a model that does not say). Measured:
the process's peak resident set (``ru_maxrss``) and, on a GPU, the device memory in use.
"""

from __future__ import annotations

import resource


def computed(trainer) -> dict:
    """{"params", "grads", "optimizer", "activations"}: bytes on this rank (activations may be None)."""
    item = trainer.device.dtype.itemsize
    flat, opt = trainer.model.flat, trainer.optimizer
    states = len(opt.state())
    rows = -(-trainer.sampler.batch // trainer.cfg.train.grad_accum_steps)  # the largest micro-batch
    per_rows = getattr(trainer.model, "activation_bytes", None)
    return {"params": flat.size * item, "grads": flat.size * item, "optimizer": states * opt.state_size * item,
            "activations": per_rows(rows) if per_rows is not None else None}


def describe(b: dict, zero: int, size: int) -> str:
    """One start-up line: the computed bytes per rank, in MB."""
    parts = [f"parameters {b['params'] / 1e6:,.2f} MB", f"gradients {b['grads'] / 1e6:,.2f} MB",
             f"optimizer state {b['optimizer'] / 1e6:,.2f} MB" + (f" (zero {zero}: a 1/{size} share)" if zero else "")]
    if b["activations"] is not None:
        parts.append(f"activations {b['activations'] / 1e6:,.2f} MB per micro-batch")
    return "memory per rank (computed): " + ", ".join(parts)


def measured(device) -> dict:
    """{"peak_rss_mb": the process's peak resident set} and, on a GPU that says, "device_used_mb"."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    used = getattr(device, "memory_used", lambda: None)()
    if used is not None:
        out["device_used_mb"] = used / 1e6
    return out

"""The training state: everything a bit-exact restart needs besides the plan.

:mod:`hpctrain.ckpt.state` writes it as logical arrays and restores it (``step`` and ``rng``
are replaced there); the step and the run loop change it. The plan (what runs where) is not
state: a restart builds its own, at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TrainingState:
    """``model``: parameters (its flat buffer); ``optimizer``: its state buffers and step count;
    ``sampler``: the data order (position = ``step``); ``rng``: this rank's generator for anything
    stochastic per rank (saved under /rng); ``compression``: the compressors' per-rank state
    (residuals, velocities, PowerSGD's Q), None without compression; ``step``: the global step the
    next update makes (0 at a fresh start); ``loss_scale``: fp16's dynamic loss scale (saved under
    /precision/loss_scale)."""

    model: object
    optimizer: object
    sampler: object
    rng: np.random.Generator
    compression: object = None
    step: int = 0
    loss_scale: object = None   # fp16's hpctrain.training.loss_scale.LossScaler, else None

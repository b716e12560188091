"""Optimizers over the flat parameter buffer (SGD, AdamW, LAMB, LARS; offloaded to the host or not)
and the learning-rate schedule. The trainer reaches them through :func:`build_optimizer`."""

from .build import build_optimizer, make_optimizer
from .elementwise import SGD, AdamW
from .layerwise import LAMB, LARS
from .schedule import LRSchedule, peak_lr

__all__ = ["build_optimizer", "make_optimizer", "SGD", "AdamW", "LAMB", "LARS", "LRSchedule", "peak_lr"]

"""Layers on top of the kernels. Parameters and gradients are views of flat buffers."""

from .flat import FlatParams
from .mlp import MLP

__all__ = ["FlatParams", "MLP"]

"""Reusable layers over the kernels. Parameters and gradients are views of flat buffers."""

from .flat import FlatParams

__all__ = ["FlatParams"]

"""One contiguous buffer for all parameters and one for all gradients.

Layers hold reshaped *views*, so the optimizer updates everything with one kernel over P elements,
the gradient buckets are slices of one buffer, and a checkpoint writes it without gathering pieces.
Parameters are laid out in layer order; gradient buckets walk it backwards.

Under a 16-bit ``train.precision`` (a :class:`~hpctrain.device.mixed.MixedDevice`) ``data`` and
``grad`` are the float32 masters and ``compute`` is the parameters rounded to the compute dtype,
which the layers read; otherwise ``compute`` is ``data`` itself. ZeRO-2 keeps gradients in reused
bucket slots (:meth:`use_grad_layout`). Under ZeRO-3 no buffer holds every parameter: ``data`` and
``compute`` become one pool of reused slots in the compute dtype, where each layer's parameters are
gathered before it runs (:meth:`use_param_layout`); the masters are this rank's packed share,
outside this class. ``dtype`` is always the masters'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSlot:
    name: str      # e.g. "fc1.weight"
    shape: tuple
    offset: int    # first element in the flat buffer
    size: int


class FlatParams:
    """Flat ``data`` and ``grad`` buffers of P elements on ``device``, with named slots, and the
    parameters as the layers read them, ``compute`` (see the module docstring)."""

    def __init__(self, device, specs, allocate: bool = True):
        """``specs``: ordered (name, shape) pairs. The buffers start zeroed; without ``allocate``
        (ZeRO-3, whose model never holds every parameter or gradient at once) there are none until
        :meth:`use_param_layout` and :meth:`use_grad_layout` give them, and a view of one is None."""
        self.slots: list[ParamSlot] = []
        offset = 0
        for name, shape in specs:
            size = math.prod(shape)
            self.slots.append(ParamSlot(name, tuple(shape), offset, size))
            offset += size
        self.size = offset
        master = getattr(device, "master", device)   # a MixedDevice's masters are its master device's
        self._master, self.dtype = master, master.dtype
        if allocate:
            self.data = master.zeros(self.size)
            self.grad = master.zeros(self.size)
            self.compute = self.data if master is device else device.zeros(self.size)
        else:
            self.data = self.grad = self.compute = None
        self._by_name = {s.name: s for s in self.slots}
        self.grad_offsets: dict[str, int] = {}  # where a gradient lives in ``grad`` if not at its slot's offset
        self.param_offsets: dict[str, int] = {}  # where a parameter lives in ``compute`` if not there (ZeRO-3)
        self.sharded = False   # ZeRO-3: ``data`` is a pool of gathered slots, not the masters

    def refresh_compute(self):
        """``compute`` <- ``data`` rounded to the compute dtype (nothing when they are one buffer).
        The models call it at the start of every forward, so the copy is never older than the
        masters, whatever changed them (an update, a checkpoint load, a rollback)."""
        if self.compute is not self.data:
            self._master.ops.narrow(self.data, self.compute)

    def grad_view(self, name):
        """The gradient of ``name`` as a shaped view of ``grad``: at the slot's offset, unless
        :meth:`use_grad_layout` placed it elsewhere (ZeRO-2's reused bucket slots)."""
        if self.grad is None:
            return None
        s = self._by_name[name]
        at = self.grad_offsets.get(name, s.offset)
        return self.grad[at:at + s.size].reshape(s.shape)

    def param_view(self, name):
        """The parameter ``name`` as the layers read it: a shaped view of ``compute`` at its slot's
        offset, or where :meth:`use_param_layout` placed it (ZeRO-3's reused slots)."""
        if self.compute is None:
            return None
        s = self._by_name[name]
        at = self.param_offsets.get(name, s.offset)
        return self.compute[at:at + s.size].reshape(s.shape)

    def use_param_layout(self, buf, offsets):
        """ZeRO-3: the parameters are read from ``buf`` at ``offsets`` (name -> first element, every
        parameter) from now on; ``buf``, in the compute dtype (16 bits under a 16-bit precision: the
        gathers round the masters), is both ``data`` and ``compute``, and the whole parameter
        buffers are dropped (the masters are the rank's share, outside this class). Layers must bind
        again (the models' ``use_param_buffer``)."""
        self.data = self.compute = buf
        self.param_offsets, self.sharded = dict(offsets), True

    def use_grad_layout(self, buf, offsets=None):
        """Keep gradients in ``buf`` from now on: at ``offsets`` (name -> first element; every
        parameter) or, without, in the parameters' layout (the current gradients are copied in).
        Layers must bind again (the models' ``use_grad_buffer``)."""
        if offsets is None:
            buf[:] = self.grad
        self.grad, self.grad_offsets = buf, dict(offsets or {})

    def view(self, buf, name):
        """The slot ``name`` of flat ``buf`` (data, grad or optimizer state) as a shaped view."""
        s = self._by_name[name]
        return buf[s.offset:s.offset + s.size].reshape(s.shape)

"""``dist.offload = "optimizer"``: the optimizer's state and its update in host memory (ZeRO-Offload).

On a GPU the optimizer's state moves to host memory and its update runs there, with the CPU
device's numba kernels; the device keeps the parameters the layers read and the gradients. The
host keeps the *masters* of what this rank updates (all, or its ZeRO chunks packed; under a 16-bit
``train.precision`` the float32 masters), so the update touches host memory only; the device's
parameters are copies written back after each update. Per gradient bucket, as the step reduces it:
:meth:`OffloadedOptimizer.fetch_gradient` queues its copy to pinned host memory, the CPU then
updates the bucket before it (waiting only for that one's copy), and the updated masters are
queued back on the device's stream (LAMB and LARS copy every gradient first, for their norms).
:class:`OffloadedOptimizer` wraps the optimizer ``optim.name`` built over the host arrays and offers
what the step, clipping, trust ratios and checkpoints use, so the rest of the trainer does not know
the difference. The CPU kernels compute the CUDA kernels' formulas: SGD and AdamW give the same bits
on numba's CUDA simulator, LAMB's norms sum in another order; on a GPU all agree to rounding.
"""

from __future__ import annotations

import types

from ..device import CpuDevice

MODES = ("none", "optimizer")


class OffloadedOptimizer:
    """The optimizer ``make(host_device, host_flat, shards, grads, params)`` builds over host arrays
    (``optimizer.make_optimizer`` with its arguments bound), fed from and feeding ``device``'s
    ``flat`` (``shards``: ZeRO's; ``grads``: ZeRO-2's packed device gradients, else None: ``flat.grad``;
    ``params``: ZeRO-3's packed device masters, else None: ``flat.data``)."""

    offloaded = True

    def __init__(self, device, flat, make, shards=None, grads=None, params=None):
        from numba import cuda

        self.device, self.flat, self.shards = device, flat, shards
        self._device_grads, self._device_params = grads, params
        size = flat.size if shards is None else shards.owned
        dtype = flat.dtype
        self.host_params = cuda.pinned_array(size, dtype=dtype)   # the masters of what this rank updates
        self.host_grads = cuda.pinned_array(size, dtype=dtype)    # their averaged gradients, copied in
        self.host_device = CpuDevice(dtype)
        host_flat = types.SimpleNamespace(slots=flat.slots, size=flat.size, data=self.host_params, grad=None,
                                          dtype=self.host_params.dtype)
        self.inner = make(self.host_device, host_flat, shards, self.host_grads, self.host_params)
        self._masters_fresh = False   # the host masters equal the device's (set at the first update)
        self._grads_here = False      # this step's gradients are all on the host already (prepare)
        self._fetched: dict = {}      # (lo, hi) -> the event after its gradient's copy to the host (fetch)
        self._events: dict = {}       # (lo, hi) -> its event, reused every step

    # ---- what the step uses ----------------------------------------------------------------
    @property
    def whole_gradient(self) -> bool:
        return getattr(self.inner, "whole_gradient", False)

    @property
    def state_size(self) -> int:
        return self.inner.state_size

    @property
    def work_arrays(self) -> int:
        return getattr(self.inner, "work_arrays", 0)

    @property
    def t(self) -> int:
        return getattr(self.inner, "t", 0)

    @t.setter
    def t(self, value: int) -> None:
        self.inner.t = value

    def state(self) -> dict:
        """The optimizer's state arrays, in host memory (``state_device`` says so; only the masters and
        gradients that cross to and from the device are pinned)."""
        return self.inner.state()

    @property
    def state_device(self):
        """The device the state arrays live on (checkpoints read and write them through it)."""
        return self.host_device

    def graph_key(self) -> tuple:
        return self.inner.graph_key()

    def masters_changed(self) -> None:
        """The device's parameters were written (a checkpoint load): the host masters follow them at
        the next update."""
        self._masters_fresh = False

    def begin_step(self, step, lr) -> None:
        if not self._masters_fresh:   # the first update, or after a load: the device's are the masters
            self._masters_from_device()
            self._masters_fresh = True
        self._grads_here = False
        self._fetched = {}
        self.inner.begin_step(step, lr)

    def grad_of(self, lo: int, hi: int):
        """The averaged gradient of the flat range [lo, hi) on the device (what clipping scales)."""
        s = slice(lo, hi)
        return self.flat.grad[s] if self._device_grads is None else self._device_grads[self._state(s)]

    def prepare(self, sum_norms) -> None:
        """LAMB and LARS: every gradient this rank updates to the host first, then the trust ratios."""
        self._copy_grads(0, self.flat.size)
        self._grads_here = True
        self.inner.prepare(sum_norms)

    def fetch_gradient(self, lo: int, hi: int) -> None:
        """Queue the copy of the averaged gradient of [lo, hi) (its reduction done) to the host, on the
        device's stream after its work, without waiting: the step fetches a bucket's gradient before it
        updates the bucket before it, so the copy runs while the CPU updates (:meth:`update` waits for
        it)."""
        if self._grads_here or (lo, hi) in self._fetched:
            return
        for a, b in self._owned_ranges(lo, hi):
            self._from_device(self.grad_of(a, b), self.host_grads[self._state(slice(a, b))])
        fence = self.device.fence   # one event per range, made at its first fetch and reused (no allocation per step)
        event = self._events.get((lo, hi)) or self._events.setdefault((lo, hi), fence.new_event())
        self._fetched[lo, hi] = fence.record(event)

    def update(self, lo: int = 0, hi: int | None = None) -> None:
        """The update of the flat range [lo, hi) (this rank's part of it): gradient down (waiting for
        the copy :meth:`fetch_gradient` queued, or copying now), CPU update, masters up (queued)."""
        hi = self.flat.size if hi is None else hi
        if not self._grads_here:
            copied = self._fetched.pop((lo, hi), None)
            if copied is None:
                self._copy_grads(lo, hi)
            else:
                copied.synchronize()
        self.inner.update(lo, hi)
        for a, b in self._owned_ranges(lo, hi):
            st = self._state(slice(a, b))
            self._params_view(a, b).copy_to_device(self.host_params[st], stream=self.device.stream)

    def step(self, lr: float, global_step: int | None = None) -> None:
        self.begin_step(global_step, lr)
        self.update()

    # ---- copies ----------------------------------------------------------------------------
    def _state(self, s: slice) -> slice:
        return s if self.shards is None else self.shards.packed(s.start, s.stop)

    def _owned_ranges(self, lo: int, hi: int) -> list:
        """The parts of [lo, hi) this rank updates (all of it without ZeRO)."""
        if self.shards is None:
            return [(lo, hi)] if lo < hi else []
        return [(max(a, lo), min(b, hi)) for a, b, _ in self.shards.pieces if max(a, lo) < min(b, hi)]

    def _params_view(self, a: int, b: int):
        """The device's parameters of the flat range [a, b) (its ZeRO-3 chunk's, packed)."""
        s = slice(a, b)
        return self.flat.data[s] if self._device_params is None else self._device_params[self._state(s)]

    def _masters_from_device(self) -> None:
        """The host masters := the device's parameters of what this rank updates."""
        if self._device_params is not None or self.shards is None:   # (ZeRO-3's packed chunks, or all of them)
            self._from_device(self._device_params if self._device_params is not None else self.flat.data,
                              self.host_params)
        else:                                                           # ZeRO-1 and 2: the owned chunks, packed
            for lo, hi, at in self.shards.pieces:
                self._from_device(self.flat.data[lo:hi], self.host_params[at:at + hi - lo])
        self.device.synchronize()

    def _copy_grads(self, lo: int, hi: int) -> None:
        for a, b in self._owned_ranges(lo, hi):
            self._from_device(self.grad_of(a, b), self.host_grads[self._state(slice(a, b))])
        self.device.synchronize()

    def _from_device(self, src, dst) -> None:
        """Device ``src`` into host ``dst`` (pinned), queued on the device's stream after its work (the
        caller synchronizes)."""
        if src.size:
            src.copy_to_host(dst, stream=self.device.stream)


def check(cfg) -> None:
    """:class:`~hpctrain.errors.ConfigError` for a ``dist.offload`` this configuration cannot run."""
    from ..errors import ConfigError

    mode = cfg.dist.offload
    if mode == "none":
        return
    if cfg.train.device == "cpu":
        raise ConfigError(f"dist.offload={mode!r} with train.device='cpu': the optimizer already runs in host "
                          f"memory, there is nothing to offload from; use dist.offload = none")
    if cfg.dist.compress != "none":
        raise ConfigError(f"dist.offload={mode!r} with dist.compress={cfg.dist.compress!r}: compression's "
                          f"momentum and residuals stay on the device; use one or the other")



"""A device computing in bf16 or fp16 over a float32 one (``train.precision``; the policy and its
rounding points: :mod:`hpctrain.precision`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..precision import Precision
from .ops import FACTS, OPS


def on_device(device, precision: Precision):
    """The device a model computes on: ``device`` itself for fp32, else a :class:`MixedDevice` over it."""
    return MixedDevice(device, precision) if precision.mixed else device


def _address(a) -> int:
    face = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return face["data"][0]


class MixedDevice:
    """``master`` (a CPU or CUDA device in float32) computing in ``precision``'s 16-bit format.

    ``dtype`` is the compute dtype: what :meth:`empty` and :meth:`zeros` give by default, so layers
    keep their activations in it; ``accum_dtype`` (float32) is for what an op saves in float32
    (LayerNorm statistics, the GPU attention's log-sum-exps) and for work arrays. ``ops`` has the
XX
    Everything else (uploads, copies, streams, the fence) is the master's."""

    def __init__(self, master, precision: Precision):
        if not precision.mixed:
            raise ValueError("a MixedDevice computes in bf16 or fp16")
        self.master, self.precision = master, precision
        self.dtype = precision.compute
        self.accum_dtype = precision.accum
        self._work: dict = {}   # elements -> float32 work arrays (:meth:`_wide`)
        ops = {}
        for name, op in vars(master.ops).items():
            rule = OPS.get(name)
            if name in FACTS or rule is not None and rule.writes is None:
                ops[name] = op
            elif rule is not None:
                ops[name] = self._converting(name, op, rule.writes)
            else:
                raise ValueError(f"op {name!r} has no rule for train.precision = {precision.name} "
                                 f"(its row in hpctrain.device.ops.OPS)")
        self.ops = SimpleNamespace(**ops)

    def __getattr__(self, name):
        return getattr(self.master, name)   # name, upload, to_host, synchronize, fence, streams, ...

    def empty(self, shape, dtype=None):
        return self.master.empty(shape, dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return self.master.zeros(shape, dtype or self.dtype)

    def describe(self) -> str:
        return f"{self.master.describe()}, compute in {self.precision.name}"

    def _wide(self, size: int, k: int):
        """The ``k``-th float32 work array of ``size`` elements: the pool holds, per size, as many as
        one op call has needed at once, shared by every op and layer (the next call may reuse them:
        an op's results are rounded back before it returns)."""
        pool = self._work.setdefault(size, [])
        while len(pool) <= k:
            pool.append(self.master.empty((size,), np.float32))
        return pool[k]

    def work_bytes(self) -> int:
        """Bytes of the float32 work arrays so far (not in the activations' count: memory the
        conversions need on top of the 16-bit arrays)."""
        return sum(4 * size * len(pool) for size, pool in self._work.items())

    def _converting(self, name, op, writes):
        import inspect

        signature = inspect.signature(op)
        params = list(signature.parameters)
        written = {}   # written parameter -> the parameter that makes it read too ("" = never read)
        for entry in writes:
            names, _, flag = entry.partition("?")
            found = [p for p in names.split("|") if p in params]
            if len(found) != 1 or flag and flag not in params:
                raise ValueError(f"op {name!r} ({', '.join(params)}) does not name the arguments "
                                 f"its row in hpctrain.device.ops.OPS says it writes: {', '.join(writes)}")
            written[found[0]] = flag
        low = self.dtype
        widen, narrow = self.master.ops.widen, self.master.ops.narrow
        quiet = None
        if self.precision.name == "fp16":
            import functools

            quiet = functools.partial(np.errstate, over="ignore", invalid="ignore")

        def call(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            seen = {}    # (address, size) -> [16-bit array, float32 copy, read?]: aliases share one copy
            keys = {}    # parameter -> its key in seen (16-bit operands only)
            counts = {}  # elements -> work arrays of that size taken by this call
            for p, a in given.items():
                if getattr(a, "dtype", None) != low:
                    continue
                _check_contiguous(a, name, p)
                key = keys[p] = (_address(a), a.size)
                flag = written.get(p)
                read = flag is None or bool(flag and given.get(flag))   # an input, or read in this mode
                entry = seen.get(key)
                if entry is None:
                    k = counts[a.size] = counts.get(a.size, -1) + 1
                    seen[key] = [a, self._wide(a.size, k), read]
                else:
                    entry[2] = entry[2] or read
            for a, w, read in seen.values():
                if read:   # an output the op only writes is not widened first
                    widen(a.reshape(a.size), w)
            call_args = {p: (seen[keys[p]][1].reshape(a.shape) if p in keys else a) for p, a in given.items()}
            if quiet is None:
                result = op(**call_args)
            else:
                with quiet():   # fp16: an overflowing step is the loss scale's to catch, not a warning's
                    result = op(**call_args)
            rounded = set()
            for p in written:
                key = keys.get(p)
                if key is not None and key not in rounded:   # a written 16-bit operand: round it back
                    a, w, _ = seen[key]
                    narrow(w, a.reshape(a.size))
                    rounded.add(key)
            return _back(result, seen)

        call.__name__ = name
        return call


def _check_contiguous(a, op, param):
    """A 16-bit operand must be one contiguous block: its float32 copy is converted back into it."""
    ok = a.flags.c_contiguous if hasattr(a, "flags") and not callable(a.flags) else a.is_c_contiguous()
    if not ok:
        raise ValueError(f"{op}: a {param} in a 16-bit compute dtype must be contiguous")


def _back(result, seen):
    """``result`` with every float32 copy the op returned replaced by its 16-bit array."""
    if isinstance(result, tuple):
        return tuple(_back(r, seen) for r in result)
    if getattr(result, "dtype", None) != np.float32:
        return result
    for orig, w, _ in seen.values():
        if _address(result) == _address(w) and result.size == w.size:
            return orig if orig.shape == result.shape else orig.reshape(result.shape)
    return result

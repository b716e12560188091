"""``train.precision``: which dtype each kind of array has, and the device that computes in them.

A :class:`Precision` names, in one place, the dtypes of a run (the design's precision policy):

  master    the parameters the optimizer updates, their gradients, and checkpoints: train.dtype
  state     the optimizer's state: the master dtype
  reduce    gradients on the wire between ranks: the master dtype
  compute   activations, their gradients and the parameters' compute copy: bf16 / fp16 (16-bit
            storage), or the master dtype for fp32
  accum     inside every op: sums of products (GEMMs), LayerNorm statistics, softmax, the loss:
            float32, kept in float32 arrays where an op saves them for backward

With bf16 or fp16 the model's layers run on a :class:`MixedDevice`: arrays they allocate are in
the compute dtype unless they ask for ``accum_dtype`` (the GPT's residual stream and its gradient,
LayerNorm statistics, a GPU attention's log-sum-exps, work arrays), and each op reads its 16-bit
operands as float32 (exactly: widening loses nothing), runs the float32 kernel, and rounds the
16-bit arguments it writes to nearest even. These are the rounding points of PyTorch's autocast:
GEMM, activation and attention outputs in 16 bits, the residual stream and everything inside an
op in float32 (docs/precision.md says where they differ). Gradients of parameters are float32
(the master dtype) and are never rounded. The parameters' compute copy is the masters rounded at
the start of every forward (:meth:`~hpctrain.nn.flat.FlatParams.refresh_compute`).

What this costs: the 16-bit arrays halve the memory of most activations kept for backward; each
op converts its 16-bit operands into float32 work arrays pooled by size and shared by every op
and layer (:meth:`MixedDevice.work_bytes`). The float32 kernels do the arithmetic, so bf16 is a
correctness and memory path, not yet a faster one: tensor-core GEMMs on 16-bit inputs are the
next step on a GPU (docs/precision.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from .errors import ConfigError
from .kernels.lowp import FORMATS, UNIT_ROUNDOFF

PRECISIONS = ("fp32", "bf16", "fp16")

# Which arguments each op writes (by parameter name; "a|b": the CPU twin's name, then the CUDA
# op's; "x?flag": x is also read when argument flag is true, as an accumulation): the 16-bit ones
# among them are rounded back after the float32 kernel ran, and are widened before it only when
# read. Each op writes every element of a written argument (so an output it only writes needs no
# old values). Every op in a device's table is here or in UNCHANGED, so a new op must be given its
# rule (a MixedDevice refuses to wrap an op it does not know, or whose parameters are not named as
# here).
WRITES = {
    "linear_forward": ("z",), "linear_backward": ("dx",),
    "tied_head_forward": ("logits",), "tied_head_backward": ("dx",),
    "bias_act_forward": ("out",), "bias_act_backward": ("dz",),
    "softmax_xent_forward": ("probs",), "softmax_xent_backward": ("dlogits",),
    "softmax_xent_fused": ("dlogits",), "softmax_xent_fused_add": ("dlogits",),
    "embedding_forward": ("out",), "embedding_backward": (),
    "layernorm_forward": ("out", "mean", "rstd"), "layernorm_backward": ("dx?add_dx",),
    "residual_layernorm_forward": ("x", "out", "mean", "rstd"),
    "attention_forward": ("out", "probs|lse"), "attention_backward": ("dqkv", "work"),
    "residual_forward": ("out",), "residual_backward": ("da?accumulate", "db?accumulate"),
}
# ops on the master dtype's flat buffers (the optimizer, the gradient's checks), the conversions
# themselves, and the table's plain attributes: used as they are
UNCHANGED = ("sgd_update", "adamw_update", "lamb_direction", "scale", "all_finite", "sum_squares", "sum_squares_each", "narrow", "widen", "fill",
             "attention_state_shapes", "attention_max_head_size", "attention_saved_kind")


@dataclass(frozen=True)
class Precision:
    """The dtypes of a run (see the module docstring). ``name``: fp32, bf16 or fp16."""

    name: str
    master: np.dtype
    compute: np.dtype
    wire: str = "fp32"   # dist.reduce_dtype: fp32 (the master dtype), bf16 or fp16

    @property
    def state(self) -> np.dtype:
        return self.master

    @property
    def reduce(self) -> np.dtype:
        """The gradients' dtype on the wire: the master's, or ``dist.reduce_dtype``'s 16-bit format
        (bf16 as its uint16 bit patterns; the fp16 / bf16 compressor sends them)."""
        return self.master if self.wire == "fp32" else FORMATS[self.wire]

    @property
    def accum(self) -> np.dtype:
        return np.dtype(np.float32) if self.mixed else self.master

    @property
    def mixed(self) -> bool:
        """Whether the model computes in a 16-bit format (a :class:`MixedDevice`)."""
        return self.name != "fp32"

    @property
    def unit_roundoff(self) -> float:
        """The relative error of one rounding to the compute format (0 for fp32: none added)."""
        return UNIT_ROUNDOFF.get(self.name, 0.0)

    def describe(self) -> str:
        if not self.mixed:
            return f"parameters, compute and optimizer state in {self.master.name}"
        return (f"{self.name} compute (activations and the parameters' copy; float32 inside each op), "
                f"{self.master.name} master parameters, gradients and optimizer state")


def policy(precision: str, dtype: str = "float32", reduce_dtype: str = "fp32") -> Precision:
    """The :class:`Precision` of ``train.precision`` over ``train.dtype`` (the master dtype), with
    gradients on the wire in ``dist.reduce_dtype``."""
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    master = np.dtype(dtype)
    if precision == "fp32":
        return Precision("fp32", master, master, reduce_dtype)
    if master != np.float32:
        raise ConfigError(f"train.precision={precision!r} keeps float32 master parameters, but train.dtype = "
                          f"{master.name}; use train.dtype = 'float32' (float64 is for exactness checks, in fp32)")
    return Precision(precision, master, FORMATS[precision], reduce_dtype)


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
    master's op names and signatures: each op converts its 16-bit operands (:data:`WRITES`).
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
            if name in UNCHANGED or not callable(op):
                ops[name] = op
            elif name in WRITES:
                ops[name] = self._converting(name, op, WRITES[name])
            else:
                raise ValueError(f"op {name!r} has no rule for train.precision = {precision.name} "
                                 f"(hpctrain.precision.WRITES)")
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
                                 f"hpctrain.precision.WRITES says it writes: {', '.join(writes)}")
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

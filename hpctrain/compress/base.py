"""The compressor interface, error feedback and the payload's size.

A compressor turns one bucket (a host float32 vector of n elements, not modified) into a
*payload*, a dict of small numpy arrays, and back: ``c.compress(x, ctx)``,
``c.decompress(payload, n, ctx)``. Its ``combine`` says how the ranks' payloads meet: "sum" (they
add elementwise and are all-reduced: fp16, bf16, random-k), "gather" (all-gathered and decoded one
by one: top-k's indices differ per rank, sign's bits do not add) or "lowrank" (PowerSGD's own two
all-reduces).

:class:`ErrorFeedback` keeps, per rank and bucket, what compression dropped and adds it to the next
step's input, so over any number of steps what was sent plus the final residual is the sum of the
inputs (to rounding). With momentum correction (``momentum`` beta > 0, ``dist.compress_momentum``,
Deep Gradient Compression) it works on a velocity u <- beta u + (1 - beta) g instead of g, and a
compressor's ``mask_sent`` zeroes in u what it sent (top-k, random-k; dense ones mask nothing);
the optimizer receives the ranks' velocities summed as its first moment (hpctrain/kernels/adamw.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Context:
    """What a compressor may depend on besides the data: identical on every rank."""

    step: int            # global optimizer step
    bucket: int          # bucket index (buckets compress independently)
    seed: int = 0        # run seed (train.seed): shared randomness (random-k) derives from it


class Compressor:
    """Base class; subclasses set ``name``, ``combine``, ``error_feedback`` and the two methods."""

    name = "none"
    combine = "sum"
    error_feedback = False

    def compress(self, x: np.ndarray, ctx: Context) -> dict:
        """The payload of x; x is not modified. With ``error_feedback`` the payload's arrays must
        not be views of x: :class:`ErrorFeedback` turns x's buffer into the residual next."""
        raise NotImplementedError

    def decompress(self, payload: dict, n: int, ctx: Context) -> np.ndarray:
        raise NotImplementedError

    def add_sent(self, payload: dict, out: np.ndarray, ctx: Context) -> None:
        """out += decompress(payload) (float32, in place); sparse payloads override it to
        touch only their entries (the same bits: adding 0.0 changes no float32 value)."""
        out += self.decompress(payload, out.size, ctx)

    def subtract_sent(self, payload: dict, out: np.ndarray, ctx: Context) -> None:
        """out -= decompress(payload) (float32, in place); see :meth:`add_sent`."""
        out -= self.decompress(payload, out.size, ctx)

    def mask_sent(self, payload: dict, velocity: np.ndarray, ctx: Context) -> None:
        """Momentum correction's masking: zero ``velocity`` where the payload sent the entry. Dense
        compressors send every entry approximately and mask nothing (the default)."""

    def describe(self) -> str:
        return self.name


def payload_bytes(payload: dict) -> int:
    """Bytes a payload puts on the wire: the sum of its arrays' sizes."""
    return int(sum(np.asarray(a).nbytes for a in payload.values()))


def momentum_update(velocity: np.ndarray, g: np.ndarray, momentum: float) -> None:
    """velocity <- momentum velocity + (1 - momentum) g, in place, in float32 (both factors
    rounded once from float64), as every path computes it."""
    velocity *= np.float32(momentum)
    velocity += np.float32(1.0 - momentum) * g.astype(np.float32, copy=False)


class ErrorFeedback:
    """Per-rank residuals, one per bucket, for a compressor with ``error_feedback``.

    ``step(x, bucket, ctx)`` compresses x + residual and keeps what the local
    decompression misses as the next residual. Residuals are float32 vectors of
    the bucket's length; ``state()`` / ``load_state()`` expose them for
    checkpoints (as /compress/residual/<bucket>). With ``momentum`` > 0 (see
    the module doc) x first goes into the bucket's velocity, which is what
    gets compressed; velocities are checkpointed as /compress/velocity/<bucket>.
    """

    def __init__(self, compressor: Compressor, momentum: float = 0.0):
        self.compressor, self.momentum = compressor, momentum
        self.residuals: dict[int, np.ndarray] = {}
        self.velocities: dict[int, np.ndarray] = {}

    def step(self, x: np.ndarray, ctx: Context) -> dict:
        c = self.compressor
        if not c.error_feedback:
            return c.compress(x, ctx)
        r = zeros_kept(self.residuals, ctx.bucket, (x.size,))
        if self.momentum:
            u = zeros_kept(self.velocities, ctx.bucket, (x.size,))
            momentum_update(u, x, self.momentum)
            x = u
        # (if compress raises, r is left as x + residual: the run stops on it, see comm/buckets.py)
        np.add(x.astype(np.float32, copy=False), r, out=r)   # r is now x + residual ...
        payload = c.compress(r, ctx)                          # (payloads hold copies, not views)
        c.subtract_sent(payload, r, ctx)                      # ... and then what was not sent
        if self.momentum:
            c.mask_sent(payload, u, ctx)
        return payload

    def state(self) -> dict:
        return {**{f"residual/{b}": r for b, r in sorted(self.residuals.items())},
                **{f"velocity/{b}": u for b, u in sorted(self.velocities.items())}}

    def load_state(self, state: dict) -> None:
        """Residuals and velocities from ``state()``'s keys; an empty dict resets both."""
        arrays = {"residual": {}, "velocity": {}}
        for k, v in state.items():
            kind, b = k.split("/")
            if kind in arrays:
                arrays[kind][int(b)] = np.asarray(v, np.float32).copy()
        self.residuals, self.velocities = arrays["residual"], arrays["velocity"]


def zeros_kept(arrays: dict, key, shape: tuple) -> np.ndarray:
    """``arrays[key]``, (re)made as float32 zeros of ``shape`` when missing or of another shape:
    per-rank state (residuals, velocities) that lives from step to step."""
    a = arrays.get(key)
    if a is None or a.shape != tuple(shape):
        a = arrays[key] = np.zeros(shape, np.float32)
    return a


class NoCompression(Compressor):
    """The identity: the payload is the float32 vector itself."""

    name, combine = "none", "sum"

    def compress(self, x, ctx):
        return {"values": np.asarray(x, np.float32)}

    def decompress(self, payload, n, ctx):
        return np.asarray(payload["values"], np.float32)

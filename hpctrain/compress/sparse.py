"""Top-k and random-k sparsification, both with error feedback.

topk(ratio): the k = ceil(ratio * n) entries of largest magnitude, sent as
(int32 indices, float32 values): 8k bytes. Indices differ per rank, so
payloads are all-gathered ("gather") and scattered-added. Selection is exact
and the same on every target: larger |x| first, NaN above every number, equal
|x| by smaller index (:func:`hpctrain.kernels.topk_threshold.topk_select`,
O(n) with ``numpy.partition``); the device path selects the same set by a
sampled threshold (hpctrain/compress/device.py).

randk(ratio): k entries at indices drawn from a generator seeded by
(seed, step, bucket), the same on every rank, so only the float32 values
travel (4k bytes) and payloads add elementwise ("sum"). Values are sent
unscaled: with error feedback the unsent part waits in the residual, which
is what makes the estimate converge (no n/k rescaling, which would inflate
the residual).
"""

from __future__ import annotations

import math

import numpy as np

from ..kernels.topk_threshold import topk_select
from .base import Compressor


def k_of(ratio: float, n: int) -> int:
    """Entries kept of n: ceil(ratio * n), at least 1 (for n >= 1)."""
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


class _Sparse(Compressor):
    """Keeps a fraction ``ratio`` of the entries; ``kind`` names it (topk, randk)."""

    kind = "sparse"
    error_feedback = True

    def __init__(self, ratio: float):
        if not 0 < ratio <= 1:
            raise ValueError(f"{self.kind} ratio {ratio}: must be in (0, 1]")
        self.ratio = ratio
        self.name = f"{self.kind}({ratio:g})"


class TopK(_Sparse):
    kind, combine = "topk", "gather"

    def compress(self, x, ctx):
        x = np.asarray(x, np.float32).reshape(-1)
        idx = topk_select(x, k_of(self.ratio, x.size)).astype(np.int32)
        return {"indices": idx, "values": x[idx]}

    def decompress(self, payload, n, ctx):
        out = np.zeros(n, np.float32)
        out[payload["indices"]] = payload["values"]
        return out


class RandK(_Sparse):
    kind, combine = "randk", "sum"

    def indices(self, n, ctx) -> np.ndarray:
        """The same k indices on every rank for (seed, step, bucket), sorted."""
        k = k_of(self.ratio, n)
        rng = np.random.default_rng([ctx.seed, ctx.step, ctx.bucket, 0x5EED])
        return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32)

    def compress(self, x, ctx):
        x = np.asarray(x, np.float32).reshape(-1)
        return {"values": x[self.indices(x.size, ctx)]}

    def decompress(self, payload, n, ctx):
        out = np.zeros(n, np.float32)
        out[self.indices(n, ctx)] = payload["values"]
        return out

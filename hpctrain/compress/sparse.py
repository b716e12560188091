"""Top-k and random-k sparsification, both with error feedback.

topk(ratio): the k = ceil(ratio * n) entries of largest magnitude, as float32 values and 16-bit
indices (a uint16 offset in its block of 65536 entries, ascending, plus an int32 count per block:
6k + 4 ceil(n / 65536) bytes). Indices differ per rank, so payloads are all-gathered ("gather")
and scatter-added. Selection is exact and the same on every target (larger |x| first, NaN above
every number, equal |x| by smaller index: :func:`hpctrain.kernels.topk_threshold.topk_select`);
the host (``topk_host``) and the device path find that set by a sampled threshold, a compaction
and an exact pick among the candidates.

randk(ratio): k entries at indices drawn from a generator seeded by (seed, step, bucket), the same
on every rank, so only the float32 values travel (4k bytes) and payloads add ("sum"). Values are
sent unscaled (no n/k factor): the unsent part waits in the error-feedback residual.
"""

from __future__ import annotations

import math

import numpy as np

from ..kernels.topk_threshold import topk_host
from .base import Compressor


INDEX_BITS = 16
INDEX_BLOCK = 1 << INDEX_BITS  # entries per block: an offset within one fits in uint16


def pack_indices(indices: np.ndarray, n: int) -> dict:
    """Ascending indices into [0, n) -> {"offsets": uint16 index mod INDEX_BLOCK,
    "block_counts": int32 indices per block}; sizes depend only on (k, n)."""
    indices = np.asarray(indices)
    if indices.size and (indices[0] < 0 or indices[-1] >= n or np.any(indices[1:] <= indices[:-1])):
        raise ValueError(f"top-k indices must be ascending and in [0, {n})")  # else the decode misplaces them
    blocks = -(-n // INDEX_BLOCK)
    counts = np.bincount(indices >> INDEX_BITS, minlength=blocks).astype(np.int32) if indices.size \
        else np.zeros(blocks, np.int32)
    return {"offsets": (indices & (INDEX_BLOCK - 1)).astype(np.uint16), "block_counts": counts}


def unpack_indices(offsets: np.ndarray, block_counts: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pack_indices`: int64 indices, ascending."""
    if int(block_counts.sum()) != offsets.size:
        raise ValueError(f"top-k payload: block counts sum to {int(block_counts.sum())}, "
                         f"{offsets.size} offsets")
    starts = np.arange(block_counts.size, dtype=np.int64) * INDEX_BLOCK
    return np.repeat(starts, block_counts) + offsets


def payload_indices(payload: dict) -> np.ndarray:
    """The int64 indices of a top-k payload (see :func:`pack_indices`)."""
    return unpack_indices(payload["offsets"], payload["block_counts"])


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
        found = topk_host(x, k_of(self.ratio, x.size))  # indices ascending
        return {**pack_indices(found.indices, x.size), "values": found.values}

    def decompress(self, payload, n, ctx):
        out = np.zeros(n, np.float32)
        out[payload_indices(payload)] = payload["values"]
        return out

    # indices are distinct, so fancy-indexed += / -= touch each entry once
    def add_sent(self, payload, out, ctx):
        out[payload_indices(payload)] += payload["values"]

    def subtract_sent(self, payload, out, ctx):
        out[payload_indices(payload)] -= payload["values"]

    def mask_sent(self, payload, velocity, ctx):
        velocity[payload_indices(payload)] = 0.0


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

    def mask_sent(self, payload, velocity, ctx):
        velocity[self.indices(velocity.size, ctx)] = 0.0

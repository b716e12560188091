"""1-bit sign compression with a scale per chunk (EF-signSGD), with error feedback.

Each chunk of ``CHUNK`` values is sent as its signs, packed 8 per byte (bit
set = negative; numpy's big-endian bit order within a byte), and one float32
scale: the chunk's mean |x|, so a chunk decodes to scale * sign(x) and keeps
its L1 norm. n values cost ceil(n / 8) + 4 ceil(n / CHUNK) bytes: ~1/30 of
float32 at CHUNK = 4096. Zeros decode as +scale (1 bit has no zero); error
feedback returns the difference next step. Packed bits do not add, so
payloads are all-gathered ("gather").
"""

from __future__ import annotations

import numpy as np

from .base import Compressor

CHUNK = 4096


class Sign(Compressor):
    name, combine, error_feedback = "sign", "gather", True

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk

    def compress(self, x, ctx):
        x = np.asarray(x, np.float32).reshape(-1)
        n, c = x.size, self.chunk
        pad = (-n) % c
        a = np.abs(np.concatenate([x, np.zeros(pad, np.float32)])).reshape(-1, c) if n else np.zeros((0, c))
        counts = np.full(a.shape[0], c, np.float64)
        if pad:
            counts[-1] = c - pad
        scales = (a.sum(axis=1, dtype=np.float64) / counts).astype(np.float32)
        return {"bits": np.packbits(x < 0), "scales": scales}

    def decompress(self, payload, n, ctx):
        negative = np.unpackbits(payload["bits"], count=n).astype(bool)
        scale = np.repeat(payload["scales"], self.chunk)[:n]
        return np.where(negative, -scale, scale).astype(np.float32)

"""1-bit sign compression with a scale per chunk (EF-signSGD), with error feedback.

Each chunk of ``CHUNK`` values is sent as its signs, packed 8 per byte (bit
set = negative; numpy's big-endian bit order within a byte), and one float32
scale: the chunk's mean |x|, so a chunk decodes to scale * sign(x) and keeps
its L1 norm (summed in float64 in a fixed order that the CUDA kernel follows
too, hpctrain/kernels/sign_pack.py, so both give the same bits). n values
cost ceil(n / 8) + 4 ceil(n / CHUNK) bytes: ~1/30 of float32 at CHUNK = 4096.
Zeros decode as +scale (1 bit has no zero); error feedback returns the
difference next step. Packed bits do not add, so payloads are all-gathered
("gather").
"""

from __future__ import annotations

import numpy as np

from ..kernels.sign_pack import chunk_scales
from .base import Compressor

CHUNK = 4096


class Sign(Compressor):
    name, combine, error_feedback = "sign", "gather", True

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk

    def compress(self, x, ctx):
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        scales = chunk_scales(x, self.chunk, np.empty(-(-x.size // self.chunk), np.float32))
        return {"bits": np.packbits(x < 0), "scales": scales}

    def decompress(self, payload, n, ctx):
        negative = np.unpackbits(payload["bits"], count=n).astype(bool)
        scale = np.repeat(payload["scales"], self.chunk)[:n]
        return np.where(negative, -scale, scale).astype(np.float32)

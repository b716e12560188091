"""fp16 and bf16: 2 bytes per value instead of 4; payloads add across ranks ("sum").

fp16 (IEEE half: 10-bit mantissa, max 65504). Overflow: values beyond
+-65504 *saturate* to +-65504 instead of becoming inf (an inf would poison
every rank's sum); ``saturated`` counts them per call. With error feedback on
(the default here) the cut-off part stays in the residual and is sent in
later steps, so even saturation loses nothing. Values below 2^-24 flush to 0
(the same residual keeps them). NaN stays NaN.

bf16 (bfloat16: fp32's exponent, 7-bit mantissa): the upper 16 bits of the
float32, rounded to nearest even. It has fp32's range, so only values within
half an ulp of fp32's max could round up to inf; they saturate to bf16's max
(3.3895e38) instead. NaN stays NaN (quiet). Relative error <= 2^-8.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .base import Compressor

FP16_MAX = float(np.finfo(np.float16).max)   # 65504
BF16_MAX_BITS = 0x7F7F                        # largest finite bf16


class Fp16(Compressor):
    """``encode``/``decode`` map float32 to the 16-bit wire format (uint16 bits) and back;
    decode(encode(decode(w))) == decode(w), so re-encoding a decoded value is exact."""

    name, combine, error_feedback = "fp16", "sum", True

    def __init__(self):
        self.saturated = 0

    def encode(self, x) -> np.ndarray:
        x = np.asarray(x, np.float32)
        self.saturated = int(np.count_nonzero(np.abs(x) > FP16_MAX))
        return np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16).view(np.uint16)  # clip keeps NaN

    @staticmethod
    def decode(bits) -> np.ndarray:
        return np.asarray(bits).view(np.float16).astype(np.float32)

    def compress(self, x, ctx):
        return {"values": self.encode(x)}

    def decompress(self, payload, n, ctx):
        return self.decode(payload["values"])


@njit(cache=True, nogil=True)
def _to_bf16(x, out):
    bits = x.view(np.uint32)
    for i in range(x.size):
        b = bits[i]
        if (b & 0x7F800000) == 0x7F800000 and (b & 0x007FFFFF) != 0:   # NaN: keep it quiet
            out[i] = np.uint16((b >> 16) | 0x0040)
            continue
        rounded = b + 0x7FFF + ((b >> 16) & 1)                         # round to nearest even
        hi = np.uint16(rounded >> 16)
        if (hi & 0x7F80) == 0x7F80 and (b & 0x7F800000) != 0x7F800000:  # finite rounded to inf
            hi = np.uint16((hi & 0x8000) | BF16_MAX_BITS)
        out[i] = hi


class Bf16(Compressor):
    """As :class:`Fp16`: ``encode``/``decode`` between float32 and the uint16 bits."""

    name, combine, error_feedback = "bf16", "sum", True

    @staticmethod
    def encode(x) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32).reshape(-1)
        out = np.empty(x.size, np.uint16)
        _to_bf16(x, out)
        return out

    @staticmethod
    def decode(bits) -> np.ndarray:
        return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)

    def compress(self, x, ctx):
        return {"values": self.encode(x)}

    def decompress(self, payload, n, ctx):
        return self.decode(payload["values"])

"""The CUDA kernels of quantize16.py: grid-stride loops of its element functions (encode with the
error feedback, decode), compiled here for the GPU from the one definition the twin compiles, so
both give the same bits. Launched by quantize16.py.
"""

from __future__ import annotations

from functools import lru_cache

from numba import cuda


@lru_cache(maxsize=None)
def quantize16_kernels(element_functions):
    """(encode_ef, decode) kernels over ``element_functions(cuda.jit(device=True))`` (quantize16.py's
    ``_element_functions``; passed in because quantize16.py imports this module)."""
    encode_ef_one, decode_one = element_functions(cuda.jit(device=True))

    @cuda.jit
    def encode_ef(x, r, bits, fmt):
        i = cuda.grid(1)
        while i < x.size:
            b, r[i] = encode_ef_one(x[i], r[i], fmt)
            bits[i] = b
            i += cuda.gridsize(1)

    @cuda.jit
    def decode(bits, out, fmt):
        i = cuda.grid(1)
        while i < bits.size:
            out[i] = decode_one(bits[i], fmt)
            i += cuda.gridsize(1)

    return encode_ef, decode

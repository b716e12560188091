"""16-bit wire formats for gradient compression (fp16, bf16), error feedback fused.

The kernels of :class:`hpctrain.compress.quantize.Fp16` / ``Bf16``; n = bucket length:

  encode_ef  x (n,) float32|float64, r (n,) float32 residual, bits (n,) uint16:
             c = float32(x) + r;  bits = enc(c);  r = c - dec(bits)     (one pass)
  decode     bits (n,) uint16 -> out (n,) float32|float64:  out = dec(bits)

enc and dec are integer bit manipulations on the float32 bits, written once
(``_element_functions``) and compiled for both targets (neither offers a float16 conversion we could
trust to round alike), bitwise identical to the host compressors:
  fp16 enc  |c| > 65504 (inf too) saturates to +-65504, as Fp16's clip; else NumPy's
            npy_floatbits_to_halfbits: nearest even, subnormals, NaN keeps its payload's top 10
            bits (never 0);  fp16 dec: NumPy's npy_halfbits_to_floatbits (exact);
  bf16 enc  the upper 16 bits rounded to nearest even, NaN kept quiet, finite values that would
            round to inf saturate;  bf16 dec: bits << 16 (exact).
On a GPU, c = x + r of a NaN is the canonical NaN, so NaN payload bits may differ from the host's;
NaN stays NaN.
"""

import numpy as np
from numba import njit

from .support.cuda_support import configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.quantize16_cuda")  # the CUDA kernels launched here (imported at the first launch)

FP16, BF16 = 0, 1           # the ``fmt`` argument of every function here
FORMATS = {"fp16": FP16, "bf16": BF16}


def _element_functions(jit):
    """(encode_ef_one, decode_one) compiled with ``jit`` (njit or cuda.jit(device=True))."""

    @jit
    def f32_bits(v):
        return int(np.float32(v).view(np.uint32))

    @jit
    def f32_of_bits(b):
        return np.uint32(b).view(np.float32)

    @jit
    def enc(f, fmt):
        """float32 bits (an int) -> 16-bit wire bits (an int)."""
        if fmt == BF16:
            if (f & 0x7F800000) == 0x7F800000 and (f & 0x007FFFFF) != 0:   # NaN: keep it quiet
                return (f >> 16) | 0x0040
            hi = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16) & 0xFFFF          # round to nearest even
            if (hi & 0x7F80) == 0x7F80 and (f & 0x7F800000) != 0x7F800000:  # finite rounded to inf
                hi = (hi & 0x8000) | 0x7F7F
            return hi
        sign = (f >> 16) & 0x8000
        mag = f & 0x7FFFFFFF
        if mag > 0x7F800000:                      # NaN
            h = 0x7C00 + ((mag & 0x007FFFFF) >> 13)
            return sign + (h + 1 if h == 0x7C00 else h)
        if mag > 0x477FE000:                      # |c| > 65504, inf included: saturate
            return sign + 0x7BFF
        exp = mag & 0x7F800000
        if exp <= 0x38000000:                     # below 2^-14: fp16 subnormal or zero
            if exp < 0x33000000:                  # below 2^-25
                return sign
            sig = (0x00800000 + (mag & 0x007FFFFF)) >> (113 - (exp >> 23))
            if (sig & 0x3FFF) != 0x1000 or (mag & 0x7FF) != 0:   # ties to even
                sig += 0x1000
            return sign + (sig >> 13)
        sig = mag & 0x007FFFFF
        if (sig & 0x3FFF) != 0x1000:              # ties to even
            sig += 0x1000
        return sign + ((exp - 0x38000000) >> 13) + (sig >> 13)   # a carry into the exponent is right

    @jit
    def dec(h, fmt):
        """16-bit wire bits (an int) -> float32 bits (an int)."""
        if fmt == BF16:
            return h << 16
        sign = (h & 0x8000) << 16
        exp = h & 0x7C00
        if exp == 0:
            sig = h & 0x03FF
            if sig == 0:
                return sign
            sig <<= 1                             # normalise the subnormal
            while (sig & 0x0400) == 0:
                sig <<= 1
                exp += 1
            return sign + ((127 - 15 - exp) << 23) + ((sig & 0x03FF) << 13)
        if exp == 0x7C00:                         # inf, NaN
            return sign + 0x7F800000 + ((h & 0x03FF) << 13)
        return sign + (((h & 0x7FFF) + 0x1C000) << 13)

    @jit
    def encode_ef_one(x, r, fmt):
        """One element: (wire bits, new residual)."""
        c = np.float32(x) + r
        b = enc(f32_bits(c), fmt)
        return b, c - f32_of_bits(dec(b, fmt))

    @jit
    def decode_one(b, fmt):
        return f32_of_bits(dec(int(b), fmt))

    return encode_ef_one, decode_one


_encode_ef_cpu, _decode_cpu = _element_functions(njit)   # the GPU's: quantize16_cuda.quantize16_kernels


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _encode_ef_loop(x, r, bits, fmt):
    for i in range(x.size):
        b, r[i] = _encode_ef_cpu(x[i], r[i], fmt)
        bits[i] = b


@njit(cache=True, nogil=True)
def _decode_loop(bits, out, fmt):
    for i in range(bits.size):
        out[i] = _decode_cpu(bits[i], fmt)


def encode_ef(x, r, bits, fmt):
    """bits <- enc(float32(x) + r); r <- what the bits miss. x, r, bits flat of one length."""
    _encode_ef_loop(x, r, bits, fmt)
    return bits


def decode(bits, out, fmt):
    """out (any float dtype) <- dec(bits)."""
    _decode_loop(bits, out, fmt)
    return out


# ---- launchers ---------------------------------------------------------------------
def encode_ef_cuda(x, r, bits, fmt, *, stream=0):
    encode, _ = kernels.quantize16_kernels(_element_functions)
    configured_elementwise(encode, x.size, stream)(x, r, bits, fmt)
    return bits


def decode_cuda(bits, out, fmt, *, stream=0):
    _, decode_kernel = kernels.quantize16_kernels(_element_functions)
    configured_elementwise(decode_kernel, bits.size, stream)(bits, out, fmt)
    return out

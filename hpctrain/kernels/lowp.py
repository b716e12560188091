"""Conversions between float32 and the 16-bit compute formats of ``train.precision``.

bf16 (bfloat16: float32's sign and 8-bit exponent, 7 mantissa bits) has no NumPy dtype, so a bf16
array is stored as ``uint16`` bit patterns; fp16 (IEEE binary16) is NumPy's ``float16``, kept as its
``uint16`` bits inside the kernels. Both directions are exact functions of the bits, written once
in integer arithmetic and compiled for the CPU (numba) and the GPU (numba CUDA), so the two give
the same bits for every input:

  narrow   float32 -> bf16 / fp16, round to nearest, ties to even (IEEE's default, as PyTorch's
           and CUDA's ``__float2bfloat16_rn`` / ``__float2half_rn``): overflow gives inf, NaN stays
           a (quiet) NaN, fp16 keeps its subnormals.
  widen    bf16 / fp16 -> float32, exact (every 16-bit value is a float32).

``narrow(src, dst)`` and ``widen(src, dst)`` take any contiguous arrays of the same size; the
format is the 16-bit side's dtype (:data:`BF16` = uint16, or float16). The CUDA launchers are the
same on device arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .support import cpu_threads
from .support.cuda_support import configured_elementwise
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.lowp_cuda")  # the CUDA kernels launched here (imported at the first launch)

BF16 = np.dtype(np.uint16)    # bf16 storage: the bit patterns
FP16 = np.dtype(np.float16)
FORMATS = {"bf16": BF16, "fp16": FP16}
# unit roundoff (half the gap between 1 and the next value): the relative error of one narrow
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


# ---- the conversions, on integers (int64 holding the bits: no unsigned wrap-around) ----------
def _f32_to_bf16(u):
    if (u & 0x7FFFFFFF) > 0x7F800000:          # NaN: keep the sign and the payload's top, set quiet
        return (u >> 16) | 0x40
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # RNE on the low 16 bits; a carry may reach inf


def _bf16_to_f32(h):
    return h << 16


def _f32_to_fp16(u):
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:                          # NaN
        return sign | 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= 0x477FF000:                         # >= 65520 (halfway above 65504) rounds to inf
        return sign | 0x7C00
    if a >= 0x38800000:                         # normal in fp16 (>= 2^-14): rebias 127 -> 15, RNE
        m = a - 0x38000000
        return sign | ((m + 0xFFF + ((m >> 13) & 1)) >> 13)
    if a < 0x33000000:                          # below half the least subnormal (2^-25): zero
        return sign
    shift = 126 - (a >> 23)                     # subnormal: value = mant * 2^(e - 150) = r * 2^-24
    mant = (a & 0x7FFFFF) | 0x800000
    r = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (r & 1) == 1):
        r += 1                                   # may carry into the least normal (0x400): right too
    return sign | r


def _fp16_to_f32(h):
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 31:                                  # inf, NaN
        return sign | 0x7F800000 | (m << 13)
    if e == 0:
        if m == 0:
            return sign
        e = 113                                  # subnormal: normalise m * 2^-24
        while (m & 0x400) == 0:
            m <<= 1
            e -= 1
        return sign | (e << 23) | ((m & 0x3FF) << 13)
    return sign | ((e + 112) << 23) | (m << 13)


# ---- CPU (numba) -----------------------------------------------------------------------------
# Four loops written out, not made by a factory as the CUDA kernels are: numba's on-disk cache
# misses a closure every time (it recompiled, and added a cache file, in every process).
_cpu_f32_to_bf16, _cpu_bf16_to_f32 = njit(inline="always")(_f32_to_bf16), njit(inline="always")(_bf16_to_f32)
_cpu_f32_to_fp16, _cpu_fp16_to_f32 = njit(inline="always")(_f32_to_fp16), njit(inline="always")(_fp16_to_f32)


@njit(cache=True, nogil=True)
def _narrow_bf16_cpu(src, dst):
    for i in range(src.size):
        dst[i] = _cpu_f32_to_bf16(np.int64(src[i]))


@njit(cache=True, nogil=True)
def _widen_bf16_cpu(src, dst):
    for i in range(src.size):
        dst[i] = _cpu_bf16_to_f32(np.int64(src[i]))


@njit(cache=True, nogil=True)
def _narrow_fp16_cpu(src, dst):
    for i in range(src.size):
        dst[i] = _cpu_f32_to_fp16(np.int64(src[i]))


@njit(cache=True, nogil=True)
def _widen_fp16_cpu(src, dst):
    for i in range(src.size):
        dst[i] = _cpu_fp16_to_f32(np.int64(src[i]))


def _bits(a, dtype):
    """A contiguous array's elements as a flat view of unsigned integers of ``dtype``."""
    if not a.flags.c_contiguous:
        raise ValueError("a precision conversion needs contiguous arrays")
    return a.reshape(-1).view(dtype)


def _check(src, dst, wide, narrow_dtype) -> None:
    if src.size != dst.size:
        raise ValueError(f"a precision conversion between {src.size} and {dst.size} elements")
    if np.dtype(wide.dtype) != np.float32 or np.dtype(narrow_dtype) not in (BF16, FP16):
        raise TypeError(f"precision conversions run between float32 and bf16 (uint16) or fp16, not "
                        f"{np.dtype(src.dtype).name} -> {np.dtype(dst.dtype).name}")


# one core's time per element (measured: 0.9-1.0 ns for 4 M elements), for cpu_threads's split
NS_PER_ELEMENT = 1.0


def _split(loop, src, dst) -> None:
    """``loop`` over the elements, split over the rank's threads when that pays (an element's
    result depends on it alone: the same bits at any thread count)."""
    n = src.size
    cpu_threads.for_rows(lambda lo, hi: loop(src[lo:hi], dst[lo:hi]), n, n, ns_per_element=NS_PER_ELEMENT)


def narrow(src, dst):
    """``dst`` (bf16 as uint16, or float16) <- ``src`` (float32) rounded to nearest even. Returns dst."""
    _check(src, dst, src, dst.dtype)
    _split(_narrow_bf16_cpu if dst.dtype == BF16 else _narrow_fp16_cpu, _bits(src, np.uint32), _bits(dst, np.uint16))
    return dst


def widen(src, dst):
    """``dst`` (float32) <- ``src`` (bf16 as uint16, or float16), exactly. Returns dst."""
    _check(src, dst, dst, src.dtype)
    _split(_widen_bf16_cpu if src.dtype == BF16 else _widen_fp16_cpu, _bits(src, np.uint16), _bits(dst, np.uint32))
    return dst


# ---- launchers ---------------------------------------------------------------------
def _device_bits(a, dtype):
    return a.reshape(a.size).view(dtype)


def narrow_cuda(src, dst, *, stream=0):
    """:func:`narrow` on device arrays, queued on ``stream``."""
    _check(src, dst, src, dst.dtype)
    kernel = kernels.conversion_kernel(_f32_to_bf16 if dst.dtype == BF16 else _f32_to_fp16)
    configured_elementwise(kernel, src.size, stream)(_device_bits(src, np.uint32),
                                                               _device_bits(dst, np.uint16))
    return dst


def widen_cuda(src, dst, *, stream=0):
    """:func:`widen` on device arrays, queued on ``stream``."""
    _check(src, dst, dst, src.dtype)
    kernel = kernels.conversion_kernel(_bf16_to_f32 if src.dtype == BF16 else _fp16_to_f32)
    configured_elementwise(kernel, src.size, stream)(_device_bits(src, np.uint16),
                                                               _device_bits(dst, np.uint32))
    return dst

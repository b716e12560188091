"""exp inside the CPU twins' numba loops: as fast as NumPy's SIMD exp in float32, libm's exp in float64.

:func:`fast_exp` (numba loops only: GELU in :mod:`~hpctrain.kernels.bias_act`, the loss in
:mod:`~hpctrain.kernels.softmax_xent`) is evaluated in the loop itself. ``math.exp`` on float32 would
call libm's scalar ``expf`` per element and keep the loop from vectorising; handing exp to NumPy
costs a second pass over memory and a Python call per block.

- float32: branch-free arithmetic that LLVM vectorises with the rest of the loop. With
  ``k = round(x / ln 2)`` and ``f = x - k ln 2`` (ln 2 in two parts, so ``k ln2_hi`` is exact),
  ``exp(x) = 2^k e^f``; ``e^f`` on ``|f| <= ln(2)/2`` is its Taylor polynomial of degree 7, and
  ``2^k`` is built from exponent bits as two factors, so every k in range is a normal float.
  Within 1.21 ulp of the result (docs/cpu.md). Above 88.72 it is inf, below -87.34 it is 0
  (exp's subnormal results are flushed), and NaN stays NaN.
- float64: ``math.exp`` (the precision runs: gradient checks, float64 training).

No fast-math (no contraction or reassociation), so a value has the same bits whether its loop ran
vectorised or not, on any thread and in any row range. numba caches the kernels that call it per
file and does not notice an edit here; ``tests/test_cpu_exp.py`` fails, naming the cache to delete,
when a cached kernel differs from a fresh compile.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

_F = np.float32
_LOG2E = _F(1.4426950408889634)
_LN2_HI = _F(0.693359375)            # 9 significant bits: k * _LN2_HI is exact for |k| <= 2^15
_LN2_LO = _F(-2.1219444005469057e-4)  # ln 2 - _LN2_HI
_ROUND = _F(12582912.0)              # 1.5 * 2^23: (t + _ROUND) - _ROUND rounds t to an integer (|t| < 2^22)
_HI = _F(88.72283)                   # exp overflows float32 above ln(FLT_MAX)
_LO = _F(-87.33654)                  # and is subnormal below ln(FLT_MIN)
_ONE = _F(1.0)
# Taylor coefficients 1/n!, n = 2..7, highest first (Horner)
_C7, _C6, _C5, _C4, _C3, _C2 = (_F(1.0 / math.factorial(n)) for n in (7, 6, 5, 4, 3, 2))


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 ``bits`` (a register bitcast)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


def _exp_float32(x):
    y = x if x >= _LO else _LO          # NaN -> _LO here (k must be a number); the result stays NaN below
    y = y if y <= _HI else _HI
    k = (y * _LOG2E + _ROUND) - _ROUND  # an integer in [-126, 128]
    f = (y - k * _LN2_HI) - k * _LN2_LO
    p = _ONE + f * (_ONE + f * (_C2 + f * (_C3 + f * (_C4 + f * (_C5 + f * (_C6 + f * _C7))))))
    ki = np.int64(k)
    half = ki >> 1                      # 2^k = 2^half 2^(k - half): both exponents normal
    r = p * _float32_from_bits(np.int32((half + 127) << 23)) * _float32_from_bits(np.int32((ki - half + 127) << 23))
    r = np.float32(np.inf) if x > _HI else r
    r = _F(0.0) if x < _LO else r
    return r if x == x else x


def fast_exp(x):
    """exp(x) in x's float dtype (numba loops only; see the module doc for float32's accuracy)."""
    return math.exp(x)


@overload(fast_exp, inline="always")
def _fast_exp(x):
    if isinstance(x, types.Float) and x.bitwidth == 32:
        return _exp_float32
    if isinstance(x, types.Float):
        return lambda x: math.exp(x)
    return None

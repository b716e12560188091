"""cpu_exp.fast_exp, the exp inside the CPU twins' numba loops, against float64 exp.

float32: within 1.5 ulp of the correctly rounded result over the whole range where exp is a
normal float, inf above it, 0 below it, NaN kept; the same bits whether the loop around it ran
vectorised or one element per call. float64: libm's exp (what math.exp gives in numba).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from hpctrain.kernels.cpu_exp import fast_exp


@njit(cache=False)
def _exp_array(x, out):
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])


@njit(cache=False)
def _exp_one(v):
    return fast_exp(v)


def _float32_inputs():
    r = np.random.default_rng(3)
    return np.concatenate([np.linspace(-87.3, 88.7, 1 << 20, dtype=np.float32),
                           r.uniform(-87.3, 88.7, 1 << 20).astype(np.float32),
                           r.uniform(-1, 1, 1 << 16).astype(np.float32),
                           np.float32([0.0, -0.0, 1.0, -1.0, 1e-8, -1e-8, 0.34657359, -0.34657359, 88.0, -87.0])])


def test_float32_within_one_and_a_half_ulp_of_float64_exp():
    x = _float32_inputs()
    out = np.empty_like(x)
    _exp_array(x, out)
    ref = np.exp(x.astype(np.float64))
    normal = (ref >= np.finfo(np.float32).tiny) & (ref <= np.finfo(np.float32).max)
    assert normal.sum() > 2_000_000
    ulp = np.spacing(ref[normal].astype(np.float32)).astype(np.float64)
    err = np.abs(out[normal].astype(np.float64) - ref[normal]) / ulp
    assert err.max() <= 1.5, f"max error {err.max():.2f} ulp at x = {x[normal][np.argmax(err)]!r}"
    assert out[x == 0][0] == 1.0


def test_float32_limits_and_nan():
    x = np.float32([88.8, 100.0, np.inf, -87.4, -100.0, -np.inf, np.nan])
    out = np.empty_like(x)
    _exp_array(x, out)
    assert np.all(np.isposinf(out[:3])), out      # overflow: inf, as exp
    assert np.all(out[3:6] == 0.0), out           # below exp's normal range: 0 (subnormals flushed)
    assert np.isnan(out[6])                       # NaN kept: a poisoned logit must stay visible


def test_float32_same_bits_vectorised_and_one_at_a_time():
    x = _float32_inputs()[::97].copy()
    out = np.empty_like(x)
    _exp_array(x, out)
    one = np.array([_exp_one(np.float32(v)) for v in x], np.float32)
    assert out.tobytes() == one.tobytes()


def test_float64_is_libm_exp():
    x = np.random.default_rng(4).uniform(-700, 700, 4096)
    out = np.empty_like(x)
    _exp_array(x, out)
    assert out.dtype == np.float64
    assert all(out[i] == math.exp(x[i]) for i in range(x.size))

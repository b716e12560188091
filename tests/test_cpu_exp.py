"""cpu_exp.fast_exp, the exp inside the CPU twins' numba loops, against float64 exp.

float32: within 1.5 ulp of the correctly rounded result over the whole range where exp is a
normal float, inf above it, 0 below it, NaN kept; the same bits whether the loop around it ran
vectorised or one element per call. float64: libm's exp (what math.exp gives in numba).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from hpctrain.kernels.support.cpu_exp import fast_exp


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


def test_float32_limits_and_nan_inside_the_vector_loop():
    special = np.float32([88.8, 100.0, np.inf, -87.4, -100.0, -np.inf, np.nan])
    x = np.random.default_rng(5).uniform(-5, 5, 4099).astype(np.float32)
    at = np.array([0, 17, 64, 1000, 2049, 3001, 4098])   # in vector bodies and in the remainder
    x[at] = special
    out = np.empty_like(x)
    _exp_array(x, out)
    got = out[at]
    assert np.all(np.isposinf(got[:3])), got       # overflow: inf, as exp
    assert np.all(got[3:6] == 0.0), got            # below exp's normal range: 0 (subnormals flushed)
    assert np.isnan(got[6])                        # NaN kept: a poisoned logit must stay visible
    rest = np.setdiff1d(np.arange(x.size), at)
    assert np.all(np.isfinite(out[rest]) & (out[rest] > 0))


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


def test_cached_kernels_that_call_it_match_a_fresh_compile():
    """numba's disk cache does not notice an edit of cpu_exp.py: a cached kernel would keep the old
    exp. Each cached caller must give the bits a fresh compile of its source gives."""
    from hpctrain.kernels import bias_act, softmax_xent

    r = np.random.default_rng(6)
    z = (3 * r.standard_normal((130, 33))).astype(np.float32)
    b = r.standard_normal(33).astype(np.float32)
    K = bias_act.gelu_constants(np.float32)
    labels = r.integers(0, 33, 130)
    rows = 128

    def gelu_forward(fn):
        zz, out = z.copy(), np.empty_like(z)
        fn(zz, b, out, K)
        return zz, out

    def gelu_backward(fn):
        dz, partials = np.empty_like(z), np.zeros((2, 33))
        fn(b[None, :] * z, z, dz, partials, 0, 2, rows, K)
        return dz, partials

    def xent(fn):
        out, partials = np.empty_like(z), np.zeros((2, 2))
        fn(z, labels, np.float32(0.5), out, True, partials, 0, 2, rows)
        return out, partials
    for name, kernel, run in (("bias_act._gelu_forward", bias_act._gelu_forward, gelu_forward),
                              ("bias_act._gelu_backward", bias_act._gelu_backward, gelu_backward),
                              ("softmax_xent._softmax_xent_rows", softmax_xent._softmax_xent_rows, xent)):
        fresh = njit(cache=False, nogil=True, error_model="numpy")(kernel.py_func)
        cached, new = (b"".join(a.tobytes() for a in run(fn)) for fn in (kernel, fresh))
        assert cached == new, (
            f"{name}: the cached kernel differs from its source (a stale numba cache after an edit of "
            f"cpu_exp.py?): delete hpctrain/kernels/__pycache__/*.nbi and *.nbc")

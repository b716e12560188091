"""The 16-bit conversions of train.precision (hpctrain/kernels/lowp.py): fp16 both ways against
NumPy's casts, bf16 narrowing against a float64 nearest-value search (ties to even), the same bits
at any thread count, and the CUDA kernels' bits against the twin's. The mixed device around them
is tests/test_precision.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.device import CudaDevice, cuda_status
from hpctrain.kernels import lowp

U_BF16, U_FP16 = 2.0 ** -8, 2.0 ** -11


def random_floats(n, seed=0):
    """float32 values from random bit patterns (every exponent, NaNs and infs included) and the
    edges: zeros, the largest finite values and the values halfway to the next format's ones."""
    bits = np.random.default_rng(seed).integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.996, 65520, -65520, 2 ** -24, 2 ** -25,
                      2 ** -25 * 1.0000001, 3 * 2 ** -26, 2 ** -14, 2 ** -14 * (1 - 2 ** -11), 1e-8, 1.0,
                      1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.3895314e38, 3.4028235e38], np.float32)
    return np.concatenate([bits.view(np.float32), edges, -edges])


# ---- CPU twin (numba) --------------------------------------------------------------------
def test_fp16_conversions_are_numpys_both_ways():
    every = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    wide = lowp.widen(every, np.empty(every.size, np.float32))
    ref = every.astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(wide.view(np.uint32)[~nan], ref.view(np.uint32)[~nan]) and np.isnan(wide[nan]).all()
    x = random_floats(1 << 20)
    got = lowp.narrow(x, np.empty(x.size, np.float16))
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    nan = np.isnan(ref)
    assert np.array_equal(got.view(np.uint16)[~nan], ref.view(np.uint16)[~nan]) and np.isnan(got[nan]).all()


def bf16_nearest(x):
    """bf16 bits of float32 ``x`` by search: the two bf16 values around x (truncation, and one
    step away from zero; past the largest finite value the next is 2^128, which rounds to inf),
    the nearer in float64, ties to the even one."""
    lo = (x.view(np.uint32) >> 16).astype(np.int64)
    hi = lo + 1
    value = lambda b: (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
    mag_hi = np.where((hi & 0x7FFF) == 0x7F80, 2.0 ** 128, np.abs(value(hi & 0xFFFF)))
    d_lo, d_hi = np.abs(np.abs(x.astype(np.float64)) - np.abs(value(lo))), mag_hi - np.abs(x.astype(np.float64))
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    return np.where(up, hi, lo).astype(np.uint16)


def test_bf16_narrow_is_the_nearest_value_ties_to_even_and_widen_is_exact():
    x = random_floats(1 << 20, seed=1)
    got = lowp.narrow(x, np.empty(x.size, lowp.BF16))
    finite = np.isfinite(x)
    assert np.array_equal(got[finite], bf16_nearest(x[finite]))
    back = lowp.widen(got, np.empty(x.size, np.float32))
    assert np.array_equal(np.isnan(back), np.isnan(x))                    # NaN stays NaN (quiet)
    inf = np.isinf(x)
    assert np.array_equal(back[inf], x[inf])
    assert np.array_equal(np.signbit(back[~np.isnan(x)]), np.signbit(x[~np.isnan(x)]))
    # exact both ways on values bf16 holds; relative error <= 2^-8 on the rest
    assert np.array_equal(lowp.narrow(back[finite], np.empty(finite.sum(), lowp.BF16)), got[finite])
    normal = finite & (np.abs(x) > 1e-37) & (np.abs(x) < 3e38)
    rel = np.abs(back[normal].astype(np.float64) / x[normal] - 1)
    assert rel.max() <= U_BF16 and rel.max() > U_BF16 / 2


def test_the_conversions_give_the_same_bits_on_any_number_of_threads(monkeypatch):
    from hpctrain.kernels.support import cpu_threads

    monkeypatch.setattr(cpu_threads, "MIN_SPLIT_NS", 0)   # split even these sizes
    x = random_floats(10_001, seed=9)
    got = {}
    try:
        for n in (1, 2, 3):
            cpu_threads.set_threads(n)
            low16 = {f: lowp.narrow(x, np.empty(x.size, lowp.FORMATS[f])) for f in lowp.FORMATS}
            got[n] = [a.view(np.uint16) for a in low16.values()]
            got[n] += [lowp.widen(a, np.empty(x.size, np.float32)).view(np.uint32) for a in low16.values()]
    finally:
        cpu_threads.set_threads(None)
    for n in (2, 3):
        assert all(np.array_equal(a, b) for a, b in zip(got[n], got[1])), n


def test_conversions_refuse_other_dtypes_and_sizes():
    with pytest.raises(TypeError):
        lowp.narrow(np.zeros(3, np.float64), np.zeros(3, lowp.BF16))
    with pytest.raises(ValueError):
        lowp.widen(np.zeros(3, lowp.BF16), np.zeros(4, np.float32))


# ---- CUDA kernels against the twin -------------------------------------------------------
@pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_cuda_conversions_give_the_cpu_bits(fmt):
    dev = CudaDevice("float32")
    x = random_floats(1500, seed=2)
    low = lowp.narrow(x, np.empty(x.size, lowp.FORMATS[fmt]))
    got = dev.to_host(dev.ops.narrow(dev.from_host(x), dev.empty(x.size, lowp.FORMATS[fmt])))
    assert np.array_equal(got.view(np.uint16), low.view(np.uint16))
    wide = dev.to_host(dev.ops.widen(dev.from_host(low, low.dtype), dev.empty(x.size, np.float32)))
    assert np.array_equal(wide.view(np.uint32), lowp.widen(low, np.empty(x.size, np.float32)).view(np.uint32))

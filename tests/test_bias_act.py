"""Bias add + activation (hpctrain/kernels/bias_act.py): the CPU twin against NumPy and finite
differences, and the CUDA kernels against the twin.

Forward passes are compared with references written here from the formulas; backward passes with
central finite differences in float64 of sum(act(z0 + b) * R). The CUDA shapes make one and two
column blocks, more rows than one backward block sums (the bias gradient then comes from row-chunk
partials), and realistic sizes on a GPU only. float32 GELU is held to its derived error bound
(tests/gelu_float32.py) on both targets, not to the other target's bits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import up
from gelu_float32 import assert_gelu_float32
from hpctrain.kernels import bias_act
from hpctrain.kernels.bias_act import bias_act_backward, bias_act_forward
from kernel_checks import FD_TOL, SHAPES, TIGHT, assert_sums_close, fd_grad, gpu, needs_cuda, rng_cuda, rng_for


# ---- reference ---------------------------------------------------------------------------
def gelu_ref(x):
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


ACTS = ["identity", "relu", "gelu"]


ACT_REF = {"identity": lambda v: v, "relu": lambda v: np.maximum(v, 0.0), "gelu": lambda v: gelu_ref(v)}


def away_from_zero(shape, key):
    """Values in +-[0.1, 2]: finite differences never straddle ReLU's kink."""
    r = rng_for(6, key, *shape)
    return r.choice([-1.0, 1.0], size=shape) * r.uniform(0.1, 2.0, size=shape)


# ---- CPU twin (numba) --------------------------------------------------------------------
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_act_forward_matches_numpy_and_keeps_pre_activation(act, shape):
    B, _, O = shape
    r = rng_for(7, *shape)
    z0, b = 3.0 * r.standard_normal((B, O)), r.standard_normal(O)
    z, out = z0.copy(), np.full((B, O), np.nan)
    assert bias_act_forward(z, b, out, act) is out
    np.testing.assert_allclose(z, z0 + b, rtol=1e-15, atol=1e-15)   # z now holds the pre-activation
    np.testing.assert_allclose(out, ACT_REF[act](z0 + b), rtol=1e-13, atol=1e-15)


def test_bias_act_forward_identity_may_write_over_z():
    z0, b = rng_for(8).standard_normal((4, 3)), rng_for(9).standard_normal(3)
    z = z0.copy()
    bias_act_forward(z, b, z, "identity")
    np.testing.assert_allclose(z, z0 + b, rtol=1e-15)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_act_backward_matches_finite_differences(act, shape):
    # objective sum(act(z0 + b) * R); z0 and b away from relu's kink at 0
    B, _, O = shape
    z0, b = away_from_zero((B, O), 1), 0.01 * away_from_zero((O,), 2)
    R = rng_for(10, *shape).standard_normal((B, O))
    work, out = np.empty((B, O)), np.empty((B, O))

    def terms():
        work[...] = z0
        return bias_act_forward(work, b, out, act) * R

    terms()  # work = z0 + b, the pre-activation backward reads
    dz, db = np.full((B, O), np.nan), np.full(O, np.nan)
    assert bias_act_backward(R, work, dz, db, act) is dz
    np.testing.assert_allclose(dz, fd_grad(terms, z0), **FD_TOL)
    np.testing.assert_allclose(db, fd_grad(terms, b), **FD_TOL)


@pytest.mark.parametrize("act", ACTS)
def test_bias_act_backward_accumulates_bias_grad_only(act):
    r = rng_for(11)
    z, dout, db0 = r.standard_normal((6, 5)), r.standard_normal((6, 5)), r.standard_normal(5)
    dz1, db1 = np.empty((6, 5)), np.zeros(5)
    bias_act_backward(dout, z, dz1, db1, act)
    dz2, db2 = np.full((6, 5), np.nan), db0.copy()
    bias_act_backward(dout, z, dz2, db2, act, accumulate=True)
    np.testing.assert_array_equal(dz2, dz1)           # dz is overwritten, never accumulated
    np.testing.assert_allclose(db2, db0 + db1, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(db1, dz1.sum(axis=0), rtol=1e-13, atol=1e-15)


def test_relu_backward_passes_positive_blocks_negative_and_zero():
    z = np.array([[-3.0, -1e-300, 0.0, -0.0, 1e-300, 2.5]])
    dout = np.array([[10.0, 20.0, 30.0, 40.0, 50.0, 60.0]])
    dz, db = np.full((1, 6), np.nan), np.empty(6)
    bias_act_backward(dout, z, dz, db, "relu")
    # subgradient at 0 is 0 (documented); strictly positive inputs pass dout
    np.testing.assert_array_equal(dz, [[0.0, 0.0, 0.0, 0.0, 50.0, 60.0]])


def test_relu_float32_forward_is_exact():
    # z + b rounds once in float32; max(., 0) adds no rounding
    r = rng_for(12)
    z, b = r.standard_normal((17, 13)).astype(np.float32), r.standard_normal(13).astype(np.float32)
    ref = np.maximum(z + b, np.float32(0))
    out = np.empty_like(z)
    bias_act_forward(z, b, out, "relu")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ref)


def test_gelu_forward_known_values():
    # gelu(0) = 0; far out it tends to relu; gelu(1) from the formula by hand:
    # 0.5 * (1 + tanh(sqrt(2/pi) * 1.044715)) = 0.8411919906082768
    z = np.array([[0.0, 1.0, 30.0, -30.0]])
    out = np.empty((1, 4))
    bias_act_forward(z, np.zeros(4), out, "gelu")
    np.testing.assert_allclose(out, [[0.0, 0.8411919906082768, 30.0, 0.0]], rtol=1e-14, atol=1e-300)


def test_gelu_float32_stays_within_its_error_bound():
    # float32 in, float32 math (constants of the array's dtype): the bound is derived in
    # tests/gelu_float32.py. It is ~16 ulps where GELU is well conditioned and catches a
    # formula change (erf vs tanh GELU differ by ~1e-4) or float64 constants slipping back
    # (bit-identical to a float64 evaluation is checked against below).
    z = np.concatenate([np.linspace(-12, 12, 4001), 3.0 * rng_for(13).standard_normal(999)]).astype(np.float32)
    z = z.reshape(100, 50)
    out, dz, db = np.empty_like(z), np.empty_like(z), np.empty(50, np.float32)
    dout = rng_for(14).standard_normal(z.shape).astype(np.float32)
    zz = z.copy()
    bias_act_forward(zz, np.zeros(50, np.float32), out, "gelu")
    bias_act_backward(dout, zz, dz, db, "gelu")
    assert out.dtype == dz.dtype == np.float32
    assert_gelu_float32(out, dz, db, z, dout)
    # the math really is float32: a float64 evaluation rounded once differs somewhere
    out64 = np.empty(z.shape)
    bias_act_forward(z.astype(np.float64), np.zeros(50), out64, "gelu")
    assert np.any(out != out64.astype(np.float32))


@pytest.mark.parametrize("act", ACTS)
def test_bias_act_writes_through_strided_views(act):
    """The twin indexes [row, col], so a transposed (non-contiguous) view gets the values, not a copy."""
    r = rng_for(18)
    z0, b = r.standard_normal((4, 6)), r.standard_normal(6)
    z, backing = z0.copy(), np.full((6, 4), np.nan)
    bias_act_forward(z, b, backing.T, act)
    np.testing.assert_allclose(backing.T, ACT_REF[act](z0 + b), rtol=1e-13, atol=1e-15)


# ---- CUDA kernels against the twin -------------------------------------------------------
# (B, O): one column block; two column blocks (O > 32); B > ROWS_PER_BLOCK so
# the bias gradient is summed from two row-chunk partials.
# (400, 3): four 128-row chunks, so the chunk partials are summed four at a time.
BIAS_SHAPES = [(9, 7), (12, 40), (130, 3), (400, 3), pytest.param((4096, 3072), marks=gpu)]


@needs_cuda
@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
@pytest.mark.parametrize("shape", BIAS_SHAPES)
def test_bias_act_forward_backward_match_twin(dev64, act, shape):
    B, O = shape
    r = rng_cuda(3, *shape)
    z0, b, dout, db0 = 2 * r.standard_normal((B, O)), r.standard_normal(O), r.standard_normal((B, O)), \
        r.standard_normal(O)
    z, out = z0.copy(), np.empty((B, O))
    bias_act.bias_act_forward(z, b, out, act)
    Z, OUT = up(dev64, z0), up(dev64, np.full((B, O), np.nan))
    dev64.ops.bias_act_forward(Z, up(dev64, b), OUT, act)
    np.testing.assert_allclose(dev64.to_host(Z), z, **TIGHT)
    np.testing.assert_allclose(dev64.to_host(OUT), out, **TIGHT)
    for accumulate in (False, True):
        dz, db = np.empty((B, O)), db0.copy()
        bias_act.bias_act_backward(dout, z, dz, db, act, accumulate)
        DZ, DB = up(dev64, np.full((B, O), np.nan)), up(dev64, db0)
        dev64.ops.bias_act_backward(up(dev64, dout), Z, DZ, DB, act, accumulate)
        np.testing.assert_allclose(dev64.to_host(DZ), dz, **TIGHT)
        assert_sums_close(dev64.to_host(DB), db, np.abs(dz).sum(axis=0) + accumulate * np.abs(db0), B + 1)


@needs_cuda
@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
def test_bias_act_outputs_may_alias_their_inputs(dev64, act):
    """dz may be dout (backward), and with identity out may be z (forward): each element is read
    before it is written, also in the kernels' four-rows-per-trip loops (130 rows reach them)."""
    r = rng_cuda(5)
    z0, b, dout = 2 * r.standard_normal((130, 40)), r.standard_normal(40), r.standard_normal((130, 40))
    Z, OUT = up(dev64, z0), up(dev64, np.zeros((130, 40)))
    dev64.ops.bias_act_forward(Z, up(dev64, b), OUT, act)
    DZ, DB = up(dev64, np.zeros((130, 40))), up(dev64, np.zeros(40))
    dev64.ops.bias_act_backward(up(dev64, dout), Z, DZ, DB, act)
    D, DB2 = up(dev64, dout), up(dev64, np.zeros(40))
    dev64.ops.bias_act_backward(D, Z, D, DB2, act)  # dz is dout
    assert dev64.to_host(D).tobytes() == dev64.to_host(DZ).tobytes()
    assert dev64.to_host(DB2).tobytes() == dev64.to_host(DB).tobytes()
    if act == "identity":
        Z2 = up(dev64, z0)
        dev64.ops.bias_act_forward(Z2, up(dev64, b), Z2, act)  # out is z
        assert dev64.to_host(Z2).tobytes() == dev64.to_host(OUT).tobytes()


@needs_cuda
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_bias_act_float32_within_the_twins_bound(dev32, act):
    # Both evaluate in float32 (constants of the array's dtype), so each is held to the
    # float32 error bound against float64 (tests/gelu_float32.py), not to the other:
    # NumPy's SIMD exp and CUDA's expf may round differently. ReLU is exact in float32.
    r = rng_cuda(4)
    z0 = np.concatenate([np.linspace(-12, 12, 299), 3 * r.standard_normal(31)]).astype(np.float32).reshape(30, 11)
    b, dout = np.zeros(11, np.float32), r.standard_normal((30, 11)).astype(np.float32)
    Z, OUT, DZ, DB = up(dev32, z0), dev32.empty((30, 11)), dev32.empty((30, 11)), dev32.empty(11)
    dev32.ops.bias_act_forward(Z, up(dev32, b), OUT, act)
    dev32.ops.bias_act_backward(up(dev32, dout), Z, DZ, DB, act)
    out, dz, db = dev32.to_host(OUT), dev32.to_host(DZ), dev32.to_host(DB)
    if act == "gelu":
        assert_gelu_float32(out, dz, db, z0, dout)
    else:
        np.testing.assert_array_equal(out, np.maximum(z0, 0))
        np.testing.assert_array_equal(dz, np.where(z0 > 0, dout, np.float32(0)))

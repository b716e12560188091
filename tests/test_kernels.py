"""CPU kernels (hpctrain.kernels) against NumPy references and finite differences.

Forward passes are compared with references written here from the formulas;
backward passes with central finite differences in float64 of the scalar
objective sum(out * R) for a random R (or of the loss itself).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpctrain.device import CpuDevice
from hpctrain.kernels.bias_act import bias_act_backward, bias_act_forward
from hpctrain.kernels.linear import linear_backward, linear_forward
from hpctrain.kernels import softmax_xent
from hpctrain.kernels.softmax_xent import softmax_xent_backward, softmax_xent_forward, softmax_xent_fused
from hpctrain.models.mlp import MLP
from gelu_float32 import assert_gelu_float32

# (B, I, O) for linear; the same triples are used as 3-D shapes for the
# elementwise ops and (B, O) for softmax: batch 1, all-ones and odd sizes.
SHAPES = [(1, 1, 1), (3, 5, 7), (17, 13, 6)]
EPS = 1e-6
# Central differences with eps=1e-6 in float64: truncation ~eps^2*f''' ~1e-12,
# rounding ~1e-16*|terms|/eps ~1e-10, both far below rtol=1e-6 of O(1e-3..1)
# gradients; atol=1e-9 covers entries that are (near) zero.
FD_TOL = dict(rtol=1e-6, atol=1e-9)
U32 = 2.0 ** -24  # float32 unit roundoff


def rng_for(*key):
    return np.random.default_rng([2024, *key])


def fd_grad(terms, x, eps=EPS):
    """Central differences of objective = terms().sum() w.r.t. every entry of ``x``.

    ``terms()`` recomputes the per-element contributions from the current ``x``
    (modified in place). The +/- results are subtracted elementwise before
    summing so that entries the perturbation does not touch cancel exactly
    instead of adding the rounding error of a large sum.
    """
    assert x.flags.c_contiguous and x.dtype == np.float64
    flat = x.reshape(-1)
    grad = np.empty(flat.size)
    for i in range(flat.size):
        old = flat[i]
        xp, xm = old + eps, old - eps
        flat[i] = xp
        tp = np.array(terms(), dtype=np.float64, copy=True)
        flat[i] = xm
        tm = np.array(terms(), dtype=np.float64, copy=True)
        flat[i] = old
        grad[i] = np.sum(tp - tm) / (xp - xm)  # xp - xm: the step actually taken
    return grad.reshape(x.shape)


# ---- references --------------------------------------------------------------------
def gelu_ref(x):
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def xent_ref(logits, labels):
    """(per-row loss, probs) from log-softmax via a stable logsumexp."""
    logits = np.asarray(logits, dtype=np.float64)
    lse = np.logaddexp.reduce(logits, axis=1)
    logp = logits - lse[:, None]
    return -logp[np.arange(len(labels)), labels], np.exp(logp)


# ---- linear (GEMM) -------------------------------------------------------------------
def linear_data(shape, dtype=np.float64):
    B, I, O = shape
    r = rng_for(1, *shape)
    x = r.standard_normal((B, I)).astype(dtype)
    w = r.standard_normal((I, O)).astype(dtype)
    b = r.standard_normal(O).astype(dtype)
    return x, w, b


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_forward_matches_numpy(shape):
    x, w, _ = linear_data(shape)
    z = np.full((shape[0], shape[2]), np.nan)
    assert linear_forward(x, w, z) is z
    np.testing.assert_allclose(z, np.einsum("bi,io->bo", x, w), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_backward_matches_finite_differences(shape):
    B, I, O = shape
    x, w, _ = linear_data(shape)
    R = rng_for(2, *shape).standard_normal((B, O))
    z = np.empty((B, O))

    def terms():
        return linear_forward(x, w, z) * R

    dx, dw = np.full((B, I), np.nan), np.full((I, O), np.nan)
    assert linear_backward(R, x, w, dx, dw) is dx
    np.testing.assert_allclose(dx, fd_grad(terms, x), **FD_TOL)
    np.testing.assert_allclose(dw, fd_grad(terms, w), **FD_TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_backward_into_flat_buffer_views(shape):
    """dw is a view of one flat gradient buffer, as FlatParams hands it out."""
    B, I, O = shape
    x, w, _ = linear_data(shape)
    dz = rng_for(3, *shape).standard_normal((B, O))
    flat = np.full(1 + I * O + 1, 7.0)  # one guard element on each side
    dw = flat[1:1 + I * O].reshape(I, O)
    linear_backward(dz, x, w, None, dw)
    np.testing.assert_allclose(dw, x.T @ dz, rtol=1e-13, atol=1e-13)
    assert flat[0] == 7.0 and flat[-1] == 7.0  # nothing written outside the views


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_backward_accumulate_adds_to_existing_grads(shape):
    B, I, O = shape
    x, w, _ = linear_data(shape)
    r = rng_for(4, *shape)
    dz = r.standard_normal((B, O))
    dw0 = r.standard_normal((I, O))
    dw, dx = dw0.copy(), np.full((B, I), np.nan)
    linear_backward(dz, x, w, dx, dw, accumulate=True)
    np.testing.assert_allclose(dw, dw0 + x.T @ dz, rtol=1e-13, atol=1e-13)
    # dx is an activation gradient, never accumulated
    np.testing.assert_allclose(dx, dz @ w.T, rtol=1e-13, atol=1e-13)

    # accumulate=False overwrites whatever was there
    linear_backward(dz, x, w, dx, dw, accumulate=False)
    np.testing.assert_allclose(dw, x.T @ dz, rtol=1e-13, atol=1e-13)


def test_linear_backward_dx_none_returns_none_and_still_fills_weight_grads():
    x, w, _ = linear_data((3, 5, 7))
    dz = rng_for(5).standard_normal((3, 7))
    dw = np.zeros((5, 7))
    assert linear_backward(dz, x, w, None, dw) is None
    np.testing.assert_allclose(dw, x.T @ dz, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_float32_forward_within_rounding_bound(shape):
    # A length-I dot product in float32 (any summation order, FMA or not) is
    # within gamma_I * |x||w| of the exact value, gamma_n = n u / (1 - n u)
    # ~ n * 2^-24. A factor 2 covers the final rounding of the stored result;
    # a wrong formula misses by O(1).
    B, I, O = shape
    x, w, _ = linear_data(shape, np.float32)
    z = np.empty((B, O), dtype=np.float32)
    linear_forward(x, w, z)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    bound = 2 * (I + 1) * U32 * (np.abs(x64) @ np.abs(w64))
    assert z.dtype == np.float32
    assert np.all(np.abs(z - x64 @ w64) <= bound)


# ---- bias add + activation ---------------------------------------------------------
ACTS = ["identity", "relu", "gelu"]
ACT_REF = {"identity": lambda v: v, "relu": lambda v: np.maximum(v, 0.0), "gelu": lambda v: gelu_ref(v)}


def away_from_zero(shape, key):
    """Values in +-[0.1, 2]: finite differences never straddle ReLU's kink."""
    r = rng_for(6, key, *shape)
    return r.choice([-1.0, 1.0], size=shape) * r.uniform(0.1, 2.0, size=shape)


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


# ---- softmax + cross-entropy --------------------------------------------------------
XENT_SHAPES = [(1, 1), (1, 2), (3, 7), (17, 6), (2, 13)]


def xent_data(shape, dtype=np.float64, scale=3.0):
    B, C = shape
    r = rng_for(14, *shape)
    return (scale * r.standard_normal((B, C))).astype(dtype), r.integers(0, C, size=B).astype(np.int64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", XENT_SHAPES + [(9, 300)])
def test_softmax_xent_fused_is_forward_then_backward_bit_for_bit(shape, dtype):
    """The fused op (training's) gives the loss, the count and the gradient of forward then
    backward, bit for bit, into a separate buffer and over the logits themselves."""
    logits, labels = xent_data(shape, dtype)
    scale = 0.37
    probs, want = np.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype)
    loss_sum, correct = softmax_xent_forward(logits, labels, probs)
    softmax_xent_backward(probs, labels, scale, want)
    apart = np.full(shape, np.nan, dtype)
    assert softmax_xent_fused(logits, labels, scale, apart) == (loss_sum, correct)
    assert apart.tobytes() == want.tobytes()
    inplace = logits.copy()
    assert softmax_xent_fused(inplace, labels, scale, inplace) == (loss_sum, correct)
    assert inplace.tobytes() == want.tobytes()


def test_softmax_xent_totals_are_written_then_added_with_the_fused_ops_values():
    (l0, y0), (l1, y1) = xent_data((5, 7)), xent_data((6, 7), scale=2.0)
    want = [softmax_xent_fused(a.copy(), y, 0.5, a.copy()) for a, y in ((l0, y0), (l1, y1))]
    totals = np.array([np.nan, np.nan])   # a diverged step's: the first micro-batch overwrites it
    g = l0.copy()
    softmax_xent.softmax_xent_fused_add(g, y0, 0.5, g, totals)
    assert totals.tolist() == [want[0][0], want[0][1]]
    ref = l0.copy()
    softmax_xent_fused(ref, y0, 0.5, ref)
    assert g.tobytes() == ref.tobytes()
    softmax_xent.softmax_xent_fused_add(l1.copy(), y1, 0.5, l1.copy(), totals, accumulate=True)
    assert totals.tolist() == [want[0][0] + want[1][0], want[0][1] + want[1][1]]


@pytest.mark.parametrize("shape", XENT_SHAPES)
def test_softmax_xent_forward_matches_logsumexp(shape):
    logits, labels = xent_data(shape)
    probs = np.full(shape, np.nan)
    loss_sum, correct = softmax_xent_forward(logits, labels, probs)
    ref_loss, ref_probs = xent_ref(logits, labels)
    assert isinstance(loss_sum, float) and isinstance(correct, int)
    np.testing.assert_allclose(loss_sum, ref_loss.sum(), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(probs, ref_probs, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-14)
    assert correct == int(np.sum(logits.argmax(axis=1) == labels))


@pytest.mark.parametrize("shape", XENT_SHAPES)
def test_softmax_xent_backward_closed_form_and_finite_differences(shape):
    B, C = shape
    logits, labels = xent_data(shape)
    probs = np.empty(shape)
    softmax_xent_forward(logits, labels, probs)
    scale = 1.0 / B  # mean loss
    dlogits = np.full(shape, np.nan)
    assert softmax_xent_backward(probs, labels, scale, dlogits) is dlogits
    onehot = np.eye(C)[labels]
    np.testing.assert_allclose(dlogits, scale * (probs - onehot), rtol=1e-14, atol=1e-16)

    row_probs = np.empty((1, C))

    def terms():  # per-row losses (one kernel call per row) times scale
        return [scale * softmax_xent_forward(logits[r:r + 1], labels[r:r + 1], row_probs)[0]
                for r in range(B)]

    np.testing.assert_allclose(dlogits, fd_grad(terms, logits), **FD_TOL)


def test_softmax_xent_backward_scale_is_applied_linearly():
    logits, labels = xent_data((3, 7))
    probs = np.empty((3, 7))
    softmax_xent_forward(logits, labels, probs)
    d1, d2 = np.empty((3, 7)), np.empty((3, 7))
    softmax_xent_backward(probs, labels, 1.0, d1)
    softmax_xent_backward(probs, labels, 0.25, d2)
    np.testing.assert_allclose(d2, 0.25 * d1, rtol=1e-15)
    np.testing.assert_allclose(d1.sum(axis=1), 0.0, atol=1e-15)  # probs sum to 1


def test_softmax_xent_stable_with_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4],      # label is the max: loss 0
                       [1e4, 0.0, -1e4],      # label 1e4 below the max: loss 1e4
                       [1e4, 1e4, 1e4],       # ties at a huge value: uniform
                       [-1e4, -1e4, -1e4 + 1.0]])
    labels = np.array([0, 1, 2, 2], dtype=np.int64)
    probs = np.full((4, 3), np.nan)
    loss_sum, correct = softmax_xent_forward(logits, labels, probs)
    ref_loss, ref_probs = xent_ref(logits, labels)
    assert np.isfinite(loss_sum) and np.all(np.isfinite(probs))
    np.testing.assert_allclose(loss_sum, ref_loss.sum(), rtol=1e-13)
    np.testing.assert_allclose(loss_sum, 0.0 + 1e4 + math.log(3) + math.log1p(2 * math.exp(-1.0)), rtol=1e-13)
    np.testing.assert_allclose(probs, ref_probs, rtol=1e-12, atol=1e-300)
    np.testing.assert_array_equal(probs[0], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(probs[2], 1.0 / 3.0, rtol=1e-15)
    # row 2 is a 3-way tie: argmax picks class 0 (first), so label 2 is not correct
    assert correct == 2  # rows 0 and 3


@pytest.mark.parametrize("n", [0, 1, 7, 8, 1001])
def test_sum_squares_is_the_float64_sum_in_a_fixed_order(n):
    from hpctrain.kernels.sum_squares import sum_squares

    x = (1e3 * np.random.default_rng(n).standard_normal(n)).astype(np.float32)
    want = float(np.sum(x.astype(np.float64) ** 2))
    got = sum_squares([x])
    assert math.isclose(got, want, rel_tol=1e-13, abs_tol=0.0)   # float64 rounding of n positive terms
    assert sum_squares([x.reshape(-1, 1)]) == got   # shape does not matter, only the order of elements
    assert math.isclose(sum_squares([x[:n // 2], x[n // 2:]]), want, rel_tol=1e-13) and sum_squares([]) == 0.0


def test_softmax_xent_refuses_labels_outside_the_classes():
    # a label out of range would read and write outside its row (another thread's, when split)
    logits = np.zeros((4, 5), np.float32)
    for bad in (5, -1):
        labels = np.array([0, 1, bad, 2])
        with pytest.raises(ValueError, match=r"labels must be in \[0, 5\)"):
            softmax_xent_fused(logits, labels, 0.25, np.empty_like(logits))
        with pytest.raises(ValueError, match=r"labels must be in \[0, 5\)"):
            softmax_xent_backward(np.full((4, 5), 0.2, np.float32), labels, 0.25, np.empty_like(logits))


def test_softmax_xent_correct_count_matches_argmax_with_ties():
    # small integer logits produce many ties; argmax takes the first maximum
    r = rng_for(15)
    logits = r.integers(-2, 3, size=(200, 5)).astype(np.float64)
    labels = r.integers(0, 5, size=200).astype(np.int64)
    probs = np.empty((200, 5))
    _, correct = softmax_xent_forward(logits, labels, probs)
    expected = int(np.sum(logits.argmax(axis=1) == labels))
    assert 0 < expected < 200
    assert correct == expected


def test_softmax_xent_float32_forward_close_to_float64_reference():
    # float32 logits: exp/normalisation happen in float32 (a few ulps, ~2.4e-7
    # relative each); the loss is accumulated in float64 from float32 parts.
    # rtol 2e-6 on probs (~16 ulps) and 1e-6 per row on the loss leave a
    # margin over that rounding yet fail on any error in the formula.
    logits, labels = xent_data((17, 6), np.float32)
    probs = np.empty((17, 6), dtype=np.float32)
    loss_sum, correct = softmax_xent_forward(logits, labels, probs)
    ref_loss, ref_probs = xent_ref(logits, labels)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs, ref_probs, rtol=2e-6, atol=1e-9)
    assert abs(loss_sum - ref_loss.sum()) <= 17 * 1e-6 * max(1.0, ref_loss.max())
    assert correct == int(np.sum(logits.argmax(axis=1) == labels))


# ---- whole MLP ---------------------------------------------------------------------
def small_mlp(activation, n_in=5, hidden=(7, 6), classes=4, seed=3):
    model = MLP(CpuDevice("float64"), n_in, list(hidden), classes, activation=activation)
    model.init(seed)
    return model


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("batch", [1, 5])
def test_mlp_gradient_matches_finite_differences_of_mean_loss(activation, batch):
    model = small_mlp(activation)
    r = rng_for(16, batch)
    x = r.standard_normal((batch, 5))
    y = r.integers(0, 4, size=batch).astype(np.int64)
    model.flat.grad[...] = np.nan
    model.forward(x, y)
    model.backward()
    analytic = model.flat.grad.copy()

    def terms():  # mean loss = loss_sum / B
        return model.forward(x, y)[0] / batch

    numeric = fd_grad(terms, model.flat.data)
    assert np.all(np.isfinite(analytic))
    np.testing.assert_allclose(analytic, numeric, **FD_TOL)
    # every parameter slot gets a gradient (no layer skipped)
    for slot in model.flat.slots:
        assert np.any(model.flat.view(model.flat.grad, slot.name) != 0), slot.name


def test_mlp_backward_accumulate_sums_two_batches():
    model = small_mlp("gelu")
    r = rng_for(17)
    x1, x2 = r.standard_normal((4, 5)), r.standard_normal((4, 5))
    y1, y2 = r.integers(0, 4, size=4), r.integers(0, 4, size=4)
    grads = []
    for x, y in ((x1, y1), (x2, y2)):
        model.forward(x, y)
        model.backward()
        grads.append(model.flat.grad.copy())
    model.forward(x1, y1)
    model.backward()
    model.forward(x2, y2)
    model.backward(accumulate=True)
    np.testing.assert_allclose(model.flat.grad, grads[0] + grads[1], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("act", ACTS)
def test_bias_act_writes_through_strided_views(act):
    """The twin indexes [row, col], so a transposed (non-contiguous) view gets the values, not a copy."""
    r = rng_for(18)
    z0, b = r.standard_normal((4, 6)), r.standard_normal(6)
    z, backing = z0.copy(), np.full((6, 4), np.nan)
    bias_act_forward(z, b, backing.T, act)
    np.testing.assert_allclose(backing.T, ACT_REF[act](z0 + b), rtol=1e-13, atol=1e-15)


# ---- finiteness check (numerical guard) ---------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_twin(dtype):
    from hpctrain.kernels.finite import all_finite

    x = np.random.default_rng(3).standard_normal(4099).astype(dtype)
    assert all_finite(x) is True
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[4098] = bad
        assert all_finite(y) is False
    # finite values whose squares overflow to inf are still finite: the exact test decides
    big = np.full(8, np.sqrt(np.finfo(dtype).max) * 2, dtype)
    assert not np.isfinite(np.dot(big, big)) and all_finite(big) is True
    # +inf and -inf whose sum is nan, and a 2-D buffer
    assert all_finite(np.array([[np.inf, -np.inf]], dtype)) is False

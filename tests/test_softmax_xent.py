"""Softmax + cross-entropy (hpctrain/kernels/softmax_xent.py): the CPU twin against a stable
logsumexp and finite differences, the fused op against forward then backward bit for bit, and the
CUDA kernels against the twin.

On the simulator C > 128 makes each of a row's 128 threads visit several classes and B > the
simulator's 2 blocks makes blocks loop over rows; on a GPU 2 x 8192 + 3 rows make each of the
(at most 8192) blocks loop over several rows, reusing its shared arrays.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import up
from hpctrain.kernels import softmax_xent
from hpctrain.kernels.softmax_xent import softmax_xent_backward, softmax_xent_forward, softmax_xent_fused
from kernel_checks import FD_TOL, TIGHT, U64, fd_grad, gpu, needs_cuda, rng_cuda, rng_for


# ---- reference ---------------------------------------------------------------------------
def xent_ref(logits, labels):
    """(per-row loss, probs) from log-softmax via a stable logsumexp."""
    logits = np.asarray(logits, dtype=np.float64)
    lse = np.logaddexp.reduce(logits, axis=1)
    logp = logits - lse[:, None]
    return -logp[np.arange(len(labels)), labels], np.exp(logp)


# ---- CPU twin (numba) --------------------------------------------------------------------
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


# ---- CUDA kernels against the twin -------------------------------------------------------
# C > 128 makes each of a row's 128 threads visit several classes; B > the
# simulator's 2 blocks makes blocks loop over rows.
# On the GPU, 2 x 8192 + 3 rows make each of the (at most 8192) blocks loop
# over several rows, reusing its shared arrays.
XENT_SHAPES_CUDA = [(1, 1), (3, 7), (17, 6), (5, 300), pytest.param((2 * 8192 + 3, 1000), marks=gpu)]


@needs_cuda
@pytest.mark.parametrize("shape", XENT_SHAPES_CUDA)
def test_softmax_xent_matches_twin(dev64, shape):
    B, C = shape
    r = rng_cuda(5, *shape)
    logits, labels = 3 * r.standard_normal((B, C)), r.integers(0, C, size=B).astype(np.int64)
    probs = np.empty((B, C))
    loss_sum, correct = softmax_xent.softmax_xent_forward(logits, labels, probs)
    P, L = up(dev64, np.full((B, C), np.nan)), up(dev64, labels)
    got_loss, got_correct = dev64.ops.softmax_xent_forward(up(dev64, logits), L, P)
    assert isinstance(got_loss, float) and isinstance(got_correct, int)
    # B per-row losses summed in different orders (each row ~ log C + O(1))
    np.testing.assert_allclose(got_loss, loss_sum, rtol=max(1e-12, 4 * B * U64))
    assert got_correct == correct
    np.testing.assert_allclose(dev64.to_host(P), probs, **TIGHT)
    d = np.empty((B, C))
    softmax_xent.softmax_xent_backward(probs, labels, 1.0 / B, d)
    D = up(dev64, np.full((B, C), np.nan))
    dev64.ops.softmax_xent_backward(P, L, 1.0 / B, D)
    np.testing.assert_allclose(dev64.to_host(D), d, **TIGHT)


@needs_cuda
@pytest.mark.parametrize("shape", XENT_SHAPES_CUDA)
@pytest.mark.parametrize("which", ["dev32", "dev64"])
def test_softmax_xent_fused_on_device_is_forward_then_backward_bit_for_bit(request, which, shape):
    """Training's fused op on the device: the loss, the count and the gradient of the device's
    forward then backward, bit for bit, into a separate buffer and over the logits themselves;
    within rounding of the CPU twin's fused op."""
    dev = request.getfixturevalue(which)
    B, C = shape
    r = rng_cuda(6, *shape)
    logits = (3 * r.standard_normal((B, C))).astype(dev.dtype)
    labels = r.integers(0, C, size=B).astype(np.int64)
    scale = 1.0 / B
    X, L, P, D = up(dev, logits), up(dev, labels), dev.empty((B, C)), dev.empty((B, C))
    loss_sum, correct = dev.ops.softmax_xent_forward(X, L, P)
    dev.ops.softmax_xent_backward(P, L, scale, D)
    want = dev.to_host(D)
    apart = up(dev, np.full((B, C), np.nan, dev.dtype))
    assert dev.ops.softmax_xent_fused(X, L, scale, apart) == (loss_sum, correct)
    assert dev.to_host(apart).tobytes() == want.tobytes()
    assert dev.ops.softmax_xent_fused(X, L, scale, X) == (loss_sum, correct)
    assert dev.to_host(X).tobytes() == want.tobytes()
    twin = logits.copy()
    ref = softmax_xent.softmax_xent_fused(twin, labels, scale, twin)
    assert ref[1] == correct
    u = float(np.finfo(dev.dtype).eps)
    np.testing.assert_allclose(loss_sum, ref[0], rtol=8 * (B + C) * u)
    np.testing.assert_allclose(want, twin, rtol=16 * u, atol=16 * u * scale)


@needs_cuda
@pytest.mark.parametrize("which", ["dev32", "dev64"])
def test_softmax_xent_totals_stay_on_the_device_written_then_added(request, which):
    """The training step's form of the fused op: the statistics go into a float64 device array,
    the first micro-batch's written over whatever it held (a NaN of a diverged step), the next
    added, with the same gradient bits as the host-returning op."""
    dev = request.getfixturevalue(which)
    B, C = XENT_SHAPES_CUDA[1]
    r = rng_cuda(7, B, C)
    parts = [((3 * r.standard_normal((B, C))).astype(dev.dtype), r.integers(0, C, size=B).astype(np.int64))
             for _ in range(2)]
    want = []
    for logits, labels in parts:
        X = up(dev, logits)
        want.append((dev.ops.softmax_xent_fused(X, up(dev, labels), 0.5, X), dev.to_host(X)))
    totals = up(dev, np.array([np.nan, np.nan]))
    for i, (logits, labels) in enumerate(parts):
        X = up(dev, logits)
        dev.ops.softmax_xent_fused_add(X, up(dev, labels), 0.5, X, totals, i > 0)
        assert dev.to_host(X).tobytes() == want[i][1].tobytes()
        if i == 0:
            assert dev.to_host(totals).tolist() == [want[0][0][0], want[0][0][1]]
    assert dev.to_host(totals).tolist() == [want[0][0][0] + want[1][0][0], want[0][0][1] + want[1][0][1]]


@needs_cuda
def test_softmax_xent_rows_of_nan_or_minus_inf_stay_in_bounds(dev64):
    # diverged training: no element beats -inf, so the argmax must fall back to
    # class 0 (as the twin) instead of reading past the row
    logits = np.array([[np.nan, np.nan, np.nan], [-np.inf, -np.inf, -np.inf], [1.0, 2.0, 3.0]])
    labels = np.array([0, 1, 2], dtype=np.int64)
    ref_probs = np.empty_like(logits)
    ref_loss, ref_correct = softmax_xent.softmax_xent_forward(logits, labels, ref_probs)
    P = dev64.empty(logits.shape)
    loss, correct = dev64.ops.softmax_xent_forward(up(dev64, logits), up(dev64, labels), P)
    assert np.isnan(loss) and np.isnan(ref_loss)
    assert correct == ref_correct == 2      # rows 0 (class 0 by fallback) and 2
    np.testing.assert_allclose(dev64.to_host(P)[2], ref_probs[2], rtol=1e-14)


@needs_cuda
def test_softmax_xent_ties_and_huge_logits_on_device(dev64):
    # ties go to the first class (as np.argmax); 1e4 logits must not overflow
    logits = np.array([[1e4, 0.0, -1e4], [1e4, 1e4, 1e4], [2.0, 5.0, 5.0], [-1e4, -1e4, -1e4 + 1.0]])
    labels = np.array([0, 2, 2, 2], dtype=np.int64)
    probs = np.empty_like(logits)
    ref = softmax_xent.softmax_xent_forward(logits, labels, probs)
    P = dev64.empty(logits.shape)
    loss, correct = dev64.ops.softmax_xent_forward(up(dev64, logits), up(dev64, labels), P)
    assert np.isfinite(loss) and correct == ref[1] == 2   # rows 0 and 3; row 2's argmax is class 1
    np.testing.assert_allclose(loss, ref[0], rtol=1e-13)
    np.testing.assert_allclose(dev64.to_host(P), probs, rtol=1e-13, atol=1e-300)

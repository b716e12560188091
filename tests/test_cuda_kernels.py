"""CUDA kernels against their CPU twins (which test_kernels.py checks against
NumPy and finite differences).

Without a GPU these run on numba's CUDA simulator (conftest sets
NUMBA_ENABLE_CUDASIM=1): every simulated thread is a Python thread, so shapes
stay at 1-130 while still leaving tiles partly filled, spanning more than one
block and making grid-stride loops iterate. The same checks at realistic sizes
are marked ``gpu`` and run only on a real GPU.

Tolerances: float64 runs compare with the twin to ~1e-12 relative (the only
differences are summation order and fused multiply-adds); float32 GEMMs are
held to the standard dot-product error bound against a float64 product.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpctrain.device import CpuDevice, CudaDevice, cuda_status
from hpctrain.kernels import adamw, bias_act, linear, scale, sgd, softmax_xent
from conftest import up
from gelu_float32 import assert_gelu_float32

pytestmark = pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")

U32, U64 = 2.0 ** -24, 2.0 ** -53
TIGHT = dict(rtol=1e-12, atol=1e-13)   # results that are not long sums (elementwise, short rows)
gpu = pytest.mark.gpu


def rng_for(*key):
    return np.random.default_rng([3031, *key])


def assert_sums_close(got, ref, abs_terms, n):
    """Two n-term float64 sums in different orders: each is within gamma_n * sum|terms|
    of the exact value (gamma_n ~ n u), so they differ by at most twice that.
    The bound grows with n, so it holds at GPU sizes too (TIGHT would not)."""
    bound = 2 * (n + 2) * U64 * abs_terms
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / np.maximum(bound, 1e-300))


# ---- GEMM --------------------------------------------------------------------------
# (M, N, K): one partial tile; K spanning two BK slabs; two by two blocks of
# 64 x 64 with ragged edges; realistic sizes on the GPU only.


# The large tiling (128 x 128, BK 8) runs the same code with other constants;
# in the simulator it is checked on one block, K spanning three slabs.
GEMM_CASES = [((5, 7, 9), "small"), ((33, 20, 17), "small"), ((70, 66, 20), "small"),
              ((5, 7, 9), "large"), ((33, 20, 17), "large"),
              pytest.param((1000, 777, 513), "small", marks=gpu), pytest.param((1000, 777, 513), "large", marks=gpu),
              pytest.param((2048, 2048, 2048), "large", marks=gpu)]


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("shape, tile", GEMM_CASES)
def test_gemm_float32_within_dot_product_bound(dev32, shape, tile, trans_a, trans_b):
    M, N, K = shape
    r = rng_for(1, *shape, trans_a, trans_b)
    a = r.standard_normal((K, M) if trans_a else (M, K)).astype(np.float32)
    b = r.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    c0 = r.standard_normal((M, N)).astype(np.float32)
    A, B = (a.T if trans_a else a).astype(np.float64), (b.T if trans_b else b).astype(np.float64)
    # |fl(sum) - sum| <= gamma_K * sum|a||b|; factor 2 for the final store, +|c0| for accumulate
    bound = 2 * (K + 2) * U32 * (np.abs(A) @ np.abs(B) + np.abs(c0))
    for accumulate in (False, True):
        c = up(dev32, c0)
        linear.gemm_cuda(up(dev32, a), up(dev32, b), c, trans_a, trans_b, accumulate, stream=dev32.stream,
                         tile=tile)
        got = dev32.to_host(c)
        ref = A @ B + (c0 if accumulate else 0)
        assert np.all(np.abs(got - ref) <= bound), (accumulate, np.abs(got - ref).max())


def test_gemm_takes_large_tiles_only_when_they_fill_the_gpu():
    sms = 132  # an H200
    assert linear.choose_tile(256, 256, sms) == "small"          # 4 large tiles: most SMs idle
    assert linear.choose_tile(4096, 4096, sms) == "large"        # 1024 large tiles
    assert linear.choose_tile(128 * 22, 128 * 12, sms) == "large"  # exactly 2 blocks per SM
    assert linear.choose_tile(128 * 22, 128 * 11, sms) == "small"  # one block per SM short
    assert linear.choose_tile(128 * 22, 128 * 12, 2 * sms) == "small"  # a bigger GPU wants more


def test_gemm_refuses_mismatched_shapes(dev32):
    a, b, c = dev32.zeros((4, 5)), dev32.zeros((6, 3)), dev32.zeros((4, 3))
    with pytest.raises(ValueError, match="gemm shapes"):
        linear.gemm_cuda(a, b, c)


LINEAR_SHAPES = [(9, 5, 7), (17, 33, 6), pytest.param((512, 1024, 768), marks=gpu)]


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_forward_backward_match_twin(dev64, shape):
    B, I, O = shape
    r = rng_for(2, *shape)
    x, w, dz = r.standard_normal((B, I)), r.standard_normal((I, O)), r.standard_normal((B, O))
    dw0 = r.standard_normal((I, O))
    z = np.empty((B, O))
    linear.linear_forward(x, w, z)
    Z = up(dev64, np.full((B, O), np.nan))
    dev64.ops.linear_forward(up(dev64, x), up(dev64, w), Z)
    assert_sums_close(dev64.to_host(Z), z, np.abs(x) @ np.abs(w), I)
    for accumulate in (False, True):
        dx, dw = np.empty((B, I)), dw0.copy()
        linear.linear_backward(dz, x, w, dx, dw, accumulate)
        DX, DW = up(dev64, np.full((B, I), np.nan)), up(dev64, dw0)
        dev64.ops.linear_backward(up(dev64, dz), up(dev64, x), up(dev64, w), DX, DW, accumulate)
        assert_sums_close(dev64.to_host(DX), dx, np.abs(dz) @ np.abs(w).T, O)
        assert_sums_close(dev64.to_host(DW), dw, np.abs(x).T @ np.abs(dz) + accumulate * np.abs(dw0), B + 1)


# ---- bias + activation -------------------------------------------------------------
# (B, O): one column block; two column blocks (O > 32); B > ROWS_PER_BLOCK so
# the bias gradient is summed from two row-chunk partials.
# (400, 3): four 128-row chunks, so the chunk partials are summed four at a time.
BIAS_SHAPES = [(9, 7), (12, 40), (130, 3), (400, 3), pytest.param((4096, 3072), marks=gpu)]


@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
@pytest.mark.parametrize("shape", BIAS_SHAPES)
def test_bias_act_forward_backward_match_twin(dev64, act, shape):
    B, O = shape
    r = rng_for(3, *shape)
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


@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
def test_bias_act_outputs_may_alias_their_inputs(dev64, act):
    """dz may be dout (backward), and with identity out may be z (forward): each element is read
    before it is written, also in the kernels' four-rows-per-trip loops (130 rows reach them)."""
    r = rng_for(5)
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


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_bias_act_float32_within_the_twins_bound(dev32, act):
    # Both evaluate in float32 (constants of the array's dtype), so each is held to the
    # float32 error bound against float64 (tests/gelu_float32.py), not to the other:
    # NumPy's SIMD exp and CUDA's expf may round differently. ReLU is exact in float32.
    r = rng_for(4)
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


# ---- softmax cross-entropy ---------------------------------------------------------
# C > 128 makes each of a row's 128 threads visit several classes; B > the
# simulator's 2 blocks makes blocks loop over rows.
# On the GPU, 2 x 8192 + 3 rows make each of the (at most 8192) blocks loop
# over several rows, reusing its shared arrays.
XENT_SHAPES = [(1, 1), (3, 7), (17, 6), (5, 300), pytest.param((2 * 8192 + 3, 1000), marks=gpu)]


@pytest.mark.parametrize("shape", XENT_SHAPES)
def test_softmax_xent_matches_twin(dev64, shape):
    B, C = shape
    r = rng_for(5, *shape)
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


@pytest.mark.parametrize("shape", XENT_SHAPES)
@pytest.mark.parametrize("which", ["dev32", "dev64"])
def test_softmax_xent_fused_on_device_is_forward_then_backward_bit_for_bit(request, which, shape):
    """Training's fused op on the device: the loss, the count and the gradient of the device's
    forward then backward, bit for bit, into a separate buffer and over the logits themselves;
    within rounding of the CPU twin's fused op."""
    dev = request.getfixturevalue(which)
    B, C = shape
    r = rng_for(6, *shape)
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


@pytest.mark.parametrize("which", ["dev32", "dev64"])
def test_softmax_xent_totals_stay_on_the_device_written_then_added(request, which):
    """The training step's form of the fused op: the statistics go into a float64 device array,
    the first micro-batch's written over whatever it held (a NaN of a diverged step), the next
    added, with the same gradient bits as the host-returning op."""
    dev = request.getfixturevalue(which)
    B, C = XENT_SHAPES[1]
    r = rng_for(7, B, C)
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


# ---- optimizers and scale ----------------------------------------------------------
OPT_SIZES = [1, 600, pytest.param(10_000_003, marks=gpu)]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("n", OPT_SIZES)
def test_sgd_step_matches_twin(dev64, n, nesterov):
    r = rng_for(6, n)
    p, g, v = r.standard_normal(n), r.standard_normal(n), r.standard_normal(n)
    P, G, V = up(dev64, p), up(dev64, g), up(dev64, v)
    for lr in (0.1, 0.05):  # two steps: the momentum state carries over
        sgd.sgd_step(p, g, v, lr, 0.9, 1e-2, nesterov)
        dev64.ops.sgd_update(P, G, V, up(dev64, sgd.hyperparameters(np.float64, lr, 0.9, 1e-2)), nesterov)
    np.testing.assert_allclose(dev64.to_host(P), p, **TIGHT)
    np.testing.assert_allclose(dev64.to_host(V), v, **TIGHT)


@pytest.mark.parametrize("n", OPT_SIZES)
@pytest.mark.parametrize("freeze,velocity", [(False, False), (True, False), (True, True)])
def test_adamw_step_matches_twin(dev64, n, freeze, velocity):
    r = rng_for(7, n)
    p, g = r.standard_normal(n), r.standard_normal(n)
    m, v = np.zeros(n), np.zeros(n)
    P, G, M, V = up(dev64, p), up(dev64, g), up(dev64, m), up(dev64, v)
    for step in (1, 2, 3):
        frozen_at = 2 if freeze and step == 3 else 0  # the second moment frozen after two updates
        vel = velocity and step == 3  # and g taken as a summed velocity (dist.compress_momentum)
        adamw.adamw_step(p, g, m, v, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, frozen_at, vel)
        hyper = adamw.hyperparameters(np.float64, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, frozen_at)
        dev64.ops.adamw_update(P, G, M, V, up(dev64, hyper), vel)
    for got, ref in ((P, p), (M, m), (V, v)):
        np.testing.assert_allclose(dev64.to_host(got), ref, **TIGHT)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scale_matches_twin_exactly(dtype):
    dev = CudaDevice(dtype)
    x = rng_for(8).standard_normal(1700).astype(dtype)  # > 3 simulated grid strides: four-element steps
    X = up(dev, x)
    dev.ops.scale(X, 1.0 / 3.0)
    # one multiplication by the same dtype-rounded factor: bitwise equal
    np.testing.assert_array_equal(dev.to_host(X), scale.scale(x.copy(), 1.0 / 3.0))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 517, 999])
def test_all_finite_matches_numpy(dtype, bad, where):
    dev = CudaDevice(dtype)
    x = rng_for(9).standard_normal(1000).astype(dtype)
    if bad is not None:
        x[where] = bad
    # the grid-stride loop must reach the last element too (2 blocks x 256 threads < 1000 in the simulator)
    assert dev.ops.all_finite(up(dev, x)) is bool(np.isfinite(x).all())


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sum_squares_matches_the_cpu_twin_and_float64(dtype):
    from hpctrain.kernels.sum_squares import sum_squares

    dev = CudaDevice(dtype)
    x = rng_for(10).standard_normal(1000).astype(dtype)   # 2 blocks of 256 in the simulator, 4 on a GPU
    parts = [x[:1], x[1:700], x[700:]]
    got = dev.ops.sum_squares([up(dev, p) for p in parts])
    want = float(np.sum(x.astype(np.float64) ** 2))
    assert math.isclose(got, want, rel_tol=1e-13) and math.isclose(got, sum_squares(parts), rel_tol=1e-13)
    assert dev.ops.sum_squares([up(dev, x[:1])]) == float(x[0]) ** 2 and dev.ops.sum_squares([]) == 0.0


def test_sum_squares_each_gives_each_groups_bits_with_one_wait(monkeypatch):
    """LAMB's and LARS's norms per parameter: every group's sum as sum_squares gives it alone (the same
    partial sums, added in the same order), with one copy to the host and one wait for all of them."""
    from numba import cuda

    from hpctrain.kernels.sum_squares import sum_squares_each

    dev = CudaDevice("float32")
    x = rng_for(11).standard_normal(1300).astype(np.float32)
    groups = [[x[:1], x[1:700]], [], [x[700:]], [x[5:9], x[900:], x[:600]]]
    alone = [dev.ops.sum_squares([up(dev, p) for p in g]) for g in groups]
    staged = [[up(dev, p) for p in g] for g in groups]
    dev.synchronize()
    waits = []
    for owner in (cuda, dev.stream):   # a wait for the device, whichever way the op takes it
        real = owner.synchronize
        monkeypatch.setattr(owner, "synchronize", lambda real=real: waits.append(1) or real())
    got = dev.ops.sum_squares_each(staged)
    assert got == alone and got[1] == 0.0 and len(waits) == 1
    assert got == sum_squares_each(groups) or all(math.isclose(a, b, rel_tol=1e-13)
                                                  for a, b in zip(got, sum_squares_each(groups)))
    assert dev.ops.sum_squares_each([]) == [] and dev.ops.sum_squares_each([[], []]) == [0.0, 0.0]


def test_gradient_clipping_on_the_device_matches_numpy():
    import types

    from hpctrain.nn.flat import ParamSlot
    from hpctrain.training.clip import EPS, GradClip

    dev = CudaDevice("float32")
    g = rng_for(11).standard_normal(600).astype(np.float32)
    grad = up(dev, g)
    one = types.SimpleNamespace(rank=0, size=1, comm=types.SimpleNamespace(allgather=lambda value: [value]))
    plan = types.SimpleNamespace(device=dev, world=one, shards=None, dp=one, grid=types.SimpleNamespace(tensor_rank=0, stage=0))
    model = types.SimpleNamespace(flat=types.SimpleNamespace(slots=[ParamSlot("w", (600,), 0, 600)]))
    clip = GradClip(plan, model, lambda lo, hi: grad[lo:hi], [(0, 250), (250, 600)], 2.0)
    norm = clip.apply()
    want = float(np.linalg.norm(g.astype(np.float64)))
    assert math.isclose(norm, want, rel_tol=1e-12) and clip.coefficient < 1.0
    np.testing.assert_array_equal(dev.to_host(grad), g * np.float32(2.0 / (want + EPS)))


# ---- a whole model -------------------------------------------------------------------
def test_mlp_step_on_cuda_equals_cpu_step(dev64):
    """forward, backward and an SGD update of a 2-hidden-layer MLP, float64."""
    from hpctrain.models.mlp import MLP

    r = rng_for(9)
    x, y = r.standard_normal((12, 8)), r.integers(0, 4, size=12).astype(np.int64)
    results = []
    for dev in (CpuDevice("float64"), dev64):
        model = MLP(dev, 8, [16, 9], 4, activation="gelu")
        model.init(5)
        loss, correct = model.forward(dev.from_host(x), dev.from_host(y, np.int64))
        model.backward()
        grad = dev.to_host(model.flat.grad).copy()
        dev.ops.sgd_update(model.flat.data, model.flat.grad, dev.zeros(model.flat.size),
                           dev.from_host(sgd.hyperparameters(dev.dtype, 0.1, 0.9, 0.0)), False)
        results.append((loss, correct, grad, dev.to_host(model.flat.data).copy()))
    (l0, c0, g0, p0), (l1, c1, g1, p1) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-12)
    assert c1 == c0
    np.testing.assert_allclose(g1, g0, **TIGHT)
    np.testing.assert_allclose(p1, p0, **TIGHT)

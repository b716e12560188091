"""Causal attention (hpctrain/kernels/attention/): the CPU twin against an einsum reference and
finite differences, the flash kernels against the twin, and the GEMM path (``model.attention =
gemm``) against the twin and the flash kernels.

Flash, on the simulator: B * NH <= 9, T <= 33 and the smallest tile (4) forced where a case should
span several tiles, so partial tiles, the online softmax's rescaling and the skipped masked tiles
are all exercised. GEMM path: on the simulator its GEMMs are NumPy's on the same device buffers
(HostBatchedGemm) and the softmax kernels run simulated; on a GPU they run on cuBLAS. Its device
is built with ``model.attention = gemm``, so the op table's own path is what is tested, and a
chunk budget of one head forces one GEMM call per head. GPT-2 sizes are marked ``gpu``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpctrain.device import CudaDevice
from hpctrain.errors import ConfigError
from hpctrain.kernels.attention import attention_backward, attention_forward, choice, flash, twin
from hpctrain.kernels.attention import gemm as gemm_path
from hpctrain.kernels.embedding import embedding_forward
from kernel_checks import FD_TOL, U32, fd_grad, gpu, needs_cuda, rng_for


DTYPES = [np.float32, np.float64]


# ---- reference (float64) -----------------------------------------------------------------
def attention_ref(qkv, n_head):
    """(out (B, T, C), P (B, NH, T, T)) by einsum with a -inf causal mask."""
    qkv = qkv.astype(np.float64)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, n_head, hs) for i in range(3))
    s = np.einsum("bthd,buhd->bhtu", q, k) / math.sqrt(hs)
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhtu,buhd->bthd", p, v).reshape(B, T, C), p


# ---- CPU twin (NumPy's BLAS + numba) -----------------------------------------------------
# (B, T, C, NH): T = 1, B = 1, head sizes 1, 3, 5 (odd), C not a power of two
ATT_SHAPES = [(1, 1, 1, 1), (2, 3, 3, 1), (1, 4, 5, 1), (2, 5, 6, 2), (2, 4, 10, 2), (3, 7, 12, 4)]


def attention_data(shape, dtype=np.float64, scale=1.0):
    B, T, C, _ = shape
    return (scale * rng_for(50, *shape).standard_normal((B, T, 3 * C))).astype(dtype)


def run_attention(qkv, n_head):
    B, T, C3 = qkv.shape
    out = np.full((B, T, C3 // 3), np.nan, qkv.dtype)
    probs = np.full((B, n_head, T, T), np.nan, qkv.dtype)
    assert attention_forward(qkv, n_head, out, probs) is out
    return out, probs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ATT_SHAPES)
def test_attention_forward_matches_reference(shape, dtype):
    B, T, C, NH = shape
    qkv = attention_data(shape, dtype)
    out, probs = run_attention(qkv, NH)
    ref_out, ref_p = attention_ref(qkv, NH)
    # float32: each output is a chain of ~hs + T + 4 roundings (the score dot
    # product in BLAS, exp and normalisation, the P v dot product), each <= u
    # relative to O(1) magnitudes here (unit normal data): 4 (hs + T + 4) u
    # covers it with margin; a missed scale or an off-by-one mask is O(0.1).
    tol = 4 * (C // NH + T + 4) * U32 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(probs, ref_p, rtol=tol, atol=tol)
    assert np.all(np.triu(probs, 1) == 0)  # exactly 0 above the diagonal
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=0, atol=T * U32 if dtype == np.float32 else 1e-14)


@pytest.mark.parametrize("shape", ATT_SHAPES)
def test_attention_backward_matches_finite_differences(shape):
    B, T, C, NH = shape
    qkv = attention_data(shape)
    R = rng_for(51, *shape).standard_normal((B, T, C))
    out, probs = np.empty((B, T, C)), np.empty((B, NH, T, T))

    def terms():
        return attention_forward(qkv, NH, out, probs) * R

    terms()
    dqkv = np.full((B, T, 3 * C), np.nan)  # overwritten, never accumulated
    assert attention_backward(R, qkv, out, probs, NH, dqkv) is dqkv
    np.testing.assert_allclose(dqkv, fd_grad(terms, qkv), **FD_TOL)


def test_attention_is_causal_from_tokens_to_outputs():
    # embedding -> fixed projection to qkv -> attention: changing the token at
    # position t0 (or any qkv row at t >= t0) leaves every output before t0
    # bit-identical (BLAS computes each score from its own row and column only)
    B, T, V, C, NH = 2, 9, 11, 6, 2
    r = rng_for(52)
    wte, wpe, w_qkv = r.standard_normal((V, C)), r.standard_normal((T, C)), r.standard_normal((C, 3 * C))
    tokens = r.integers(0, V, size=(B, T))

    def model(tok):
        x = embedding_forward(tok, wte, wpe, np.empty((B, T, C)))
        return run_attention(np.ascontiguousarray(x @ w_qkv), NH)[0]

    base = model(tokens)
    for t0 in (0, 4, T - 1):
        changed = tokens.copy()
        changed[:, t0] = (changed[:, t0] + 1 + t0) % V
        after = model(changed)
        np.testing.assert_array_equal(after[:, :t0], base[:, :t0])
        assert not np.allclose(after[:, t0], base[:, t0])  # the change did reach position t0
    qkv = attention_data((B, T, C, NH))
    base = run_attention(qkv, NH)[0]
    later = qkv.copy()
    later[:, 5:] = 1e3 * r.standard_normal((B, T - 5, 3 * C))
    np.testing.assert_array_equal(run_attention(later, NH)[0][:, :5], base[:, :5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_stable_with_huge_scores(dtype):
    # q, k ~ 100: scores ~ 1e4 / sqrt(hs); exp without the max subtracted
    # overflows (float32 at 88, float64 at 709)
    B, T, C, NH = 2, 6, 8, 2
    qkv = attention_data((B, T, C, NH), dtype, scale=100.0)
    out, probs = run_attention(qkv, NH)
    assert np.abs(qkv[..., :C] @ qkv[..., C:2 * C].swapaxes(1, 2)).max() > 1e4
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(probs))
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-5)
    ref_out, _ = attention_ref(qkv, NH)
    if dtype == np.float64:  # float32 scores ~1e4 carry ~1e-3 absolute error: no tight comparison
        np.testing.assert_allclose(out, ref_out, rtol=1e-9, atol=1e-9)
    dqkv = np.empty_like(qkv)
    attention_backward(np.ones_like(out), qkv, out, probs, NH, dqkv)
    assert np.all(np.isfinite(dqkv))


def test_attention_rejects_bad_shapes():
    qkv = attention_data((1, 3, 6, 2))
    with pytest.raises(ValueError, match="divisible by n_head"):
        attention_forward(qkv, 4, np.empty((1, 3, 6)), np.empty((1, 4, 3, 3)))
    with pytest.raises(ValueError, match="probs has shape"):
        attention_forward(qkv, 2, np.empty((1, 3, 6)), np.empty((1, 2, 3, 4)))
    with pytest.raises(ValueError, match="C-contiguous"):
        attention_backward(np.empty((1, 3, 6)), qkv, np.empty((1, 3, 6)), np.empty((1, 2, 3, 3)), 2,
                           np.empty((1, 3, 36))[..., ::2])


# ---- CUDA: the flash kernels against the twin --------------------------------------------
def inputs(B, T, NH, hs, seed=0):
    """qkv (B, T, 3C) and dout (B, T, C), float64 values exactly representable in float32."""
    r = np.random.default_rng([4177, B, T, NH, hs, seed])
    C = NH * hs
    qkv = r.standard_normal((B, T, 3 * C)).astype(np.float32).astype(np.float64)
    return qkv, r.standard_normal((B, T, C)).astype(np.float32).astype(np.float64)


def twin_results(qkv, dout, NH):
    """(out, dqkv) of the CPU twin, in qkv's dtype."""
    B, T, C3 = qkv.shape
    out, probs, dqkv = np.empty((B, T, C3 // 3), qkv.dtype), np.empty((B, NH, T, T), qkv.dtype), np.empty_like(qkv)
    attention_forward(qkv, NH, out, probs)
    attention_backward(dout, qkv, out, probs, NH, dqkv)
    return out, dqkv


def run_flash(dev, qkv, dout, NH, tile=None, backward_runs=1):
    """(out, lse, [dqkv per backward run]) of the kernels on dev, in dev's dtype."""
    B, T, C3 = qkv.shape
    lse_shape, work_shape = flash.attention_state_shapes_cuda(B, NH, T)
    dt = np.dtype(dev.dtype)
    Q, DO = dev.from_host(qkv.astype(dt), dt), dev.from_host(dout.astype(dt), dt)
    O, L = dev.from_host(np.full((B, T, C3 // 3), np.nan, dt), dt), dev.from_host(np.full(lse_shape, np.nan, dt), dt)
    flash.attention_forward_cuda(Q, NH, O, L, stream=dev.stream, tile=tile)
    grads = []
    for _ in range(backward_runs):
        # NaN-filled: an element the kernels fail to write shows up
        DQ, W = dev.from_host(np.full(qkv.shape, np.nan, dt), dt), dev.empty(work_shape)
        flash.attention_backward_cuda(DO, Q, O, L, NH, DQ, W, stream=dev.stream, tile=tile)
        grads.append(dev.to_host(DQ))
    return dev.to_host(O), dev.to_host(L), grads


def numpy_lse(qkv, NH):
    """(B, NH, T) log-sum-exp of each row's scaled, masked scores, in float64."""
    q, k = (twin._qkv_heads(qkv, NH, i) for i in range(2))
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    T = qkv.shape[1]
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]


def float32_bound(qkv, NH):
    """The float32 kernels' bound, relative to each result's scale: (T + hs (1 + max scaled
    sum|q k|)) u, x4 for the chained steps (see the float32 test below). Per batch row, so
    GPT-2-size scores are never held at once."""
    B, T, C3 = qkv.shape
    hs = C3 // 3 // NH
    q, k = (np.abs(twin._qkv_heads(qkv, NH, i)) for i in range(2))
    smax = max(float((q[b] @ k[b].swapaxes(-1, -2)).max()) for b in range(B)) / np.sqrt(hs)
    return 4 * (T + hs * (1 + smax)) * U32


def assert_close_to_scale(got, ref, rel):
    """|got - ref| <= rel * max|ref| elementwise. Relative to the array's scale, not to each
    element: dS = P (dP - D) cancels, so a small gradient carries the absolute rounding
    error of the large terms it was summed from."""
    assert np.all(np.isfinite(got))
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-300)
    assert err <= rel, (err, rel)


# (B, T, NH, hs, tile): T = 1; batch 2 with 2 heads of odd size and T ragged in two tiles;
# T = 33 over nine tiles of 4 (one row in the last); the launcher's own tile (8 for T = 7), hs = 1
FLASH_CASES = [(1, 1, 1, 1, 4), (2, 5, 2, 3, 4), (1, 33, 1, 5, 4), (1, 7, 3, 1, None)]


@needs_cuda
@pytest.mark.parametrize("B, T, NH, hs, tile", FLASH_CASES)
def test_flash_float64_matches_twin_and_numpy_lse(dev64, B, T, NH, hs, tile):
    # float64: the only differences from the twin are summation order, exp/log's last bit and
    # D = rowsum(dO * O) in place of rowsum(dP * P): each result is a sum of at most ~T * hs
    # terms, so about T * hs * 2^-53 (~2e-14 at T=33, hs=5) of its scale; 1e-12 leaves 50x margin
    qkv, dout = inputs(B, T, NH, hs)
    out_ref, dqkv_ref = twin_results(qkv, dout, NH)
    out, lse, (dqkv,) = run_flash(dev64, qkv, dout, NH, tile)
    assert_close_to_scale(out, out_ref, 1e-12)
    assert_close_to_scale(dqkv, dqkv_ref, 1e-12)
    np.testing.assert_allclose(lse, numpy_lse(qkv, NH), rtol=1e-13, atol=1e-13)


@needs_cuda
def test_causal_future_positions_change_nothing_before_them(dev64):
    B, T, NH, hs, t = 1, 11, 2, 3, 5
    qkv, dout = inputs(B, T, NH, hs, seed=1)
    dout[:, t + 1:] = 0
    out, lse, (dqkv,) = run_flash(dev64, qkv, dout, NH, tile=4)
    changed = qkv.copy()
    changed[:, t + 1:] = inputs(B, T, NH, hs, seed=2)[0][:, t + 1:]  # new q, k, v after t
    out2, lse2, (dqkv2,) = run_flash(dev64, changed, dout, NH, tile=4)
    # masked scores are exactly exp(-inf) = 0, so rows <= t are bitwise the same
    np.testing.assert_array_equal(out2[:, :t + 1], out[:, :t + 1])
    np.testing.assert_array_equal(lse2[..., :t + 1], lse[..., :t + 1])
    np.testing.assert_array_equal(dqkv2[:, :t + 1], dqkv[:, :t + 1])
    # dout is zero after t: nothing reaches q, k, v after t (dV, dP and D vanish there)
    np.testing.assert_array_equal(dqkv[:, t + 1:], 0)
    assert np.any(out2[:, t + 1:] != out[:, t + 1:])  # the change did reach the later rows


@needs_cuda
def test_float32_within_bound_of_float64_and_deterministic(dev32):
    # Inputs are float32-exact, so all error is the kernels' float32 arithmetic. A score is an
    # hs-term dot (error <= hs u sum|q k| scale, which exp turns into a relative error of P);
    # lse, out and the gradients add sums of up to T terms of P-weighted rows. So each result is
    # within about (T + hs (1 + max scaled sum|q k|)) u of its scale; factor 4 for the few
    # chained steps (exp, D's dot, dS's difference). Measured: 45-170x below the bound.
    B, T, NH, hs = 1, 18, 2, 5   # five tiles of 4, two rows in the last
    qkv, dout = inputs(B, T, NH, hs, seed=3)
    out_ref, dqkv_ref = twin_results(qkv, dout, NH)
    out, lse, (dqkv, dqkv_again) = run_flash(dev32, qkv, dout, NH, tile=4, backward_runs=2)
    rel = float32_bound(qkv, NH)
    assert_close_to_scale(out.astype(np.float64), out_ref, rel)
    assert_close_to_scale(lse.astype(np.float64), numpy_lse(qkv, NH), rel)
    assert_close_to_scale(dqkv.astype(np.float64), dqkv_ref, rel)
    # no atomics: each element is summed by one thread in a fixed order, so the bits repeat
    np.testing.assert_array_equal(dqkv_again.view(np.uint32), dqkv.view(np.uint32))


@needs_cuda
def test_tile_choice_follows_shared_memory_and_T():
    choose = flash.choose_tile
    assert choose("forward", np.float32, 64, 1024) == 32     # Q, K, V of 32 x 65 float32: 29 KiB
    assert choose("forward", np.float32, 128, 1024) == 16    # at 32: 54 KiB, over the limit
    assert choose("backward_dkv", np.float64, 128, 1024) == 8
    assert choose("forward", np.float32, 64, 7) == 8          # no larger than T's power of two
    assert choose("forward", np.float32, 64, 1) == 4
    for kind in ("forward", "backward_dkv", "backward_dq"):
        for dt in (np.float32, np.float64):
            for hs in (1, 32, 33, 64, 65, 128):
                t = choose(kind, dt, hs, 4096)
                assert flash._smem_bytes(kind, t, flash.hs_capacity(hs),
                                         np.dtype(dt).itemsize) <= flash.SMEM_LIMIT
    with pytest.raises(ValueError, match="limit of 128"):
        choose("forward", np.float32, 129, 64)


@needs_cuda
def test_flash_bad_shapes_raise(dev64):
    B, T, NH, hs = 2, 5, 2, 3
    C = NH * hs
    qkv, out, lse = dev64.zeros((B, T, 3 * C)), dev64.zeros((B, T, C)), dev64.zeros((B, NH, T))
    fwd, bwd = flash.attention_forward_cuda, flash.attention_backward_cuda
    with pytest.raises(ValueError, match="3\\*C"):
        fwd(dev64.zeros((B, T, 3 * C + 1)), NH, out, lse)
    with pytest.raises(ValueError, match="multiple of n_head"):
        fwd(qkv, 4, out, lse)
    with pytest.raises(ValueError, match="out has shape"):
        fwd(qkv, NH, dev64.zeros((B, T + 1, C)), lse)
    with pytest.raises(ValueError, match="lse has shape"):
        fwd(qkv, NH, out, dev64.zeros((B, T, NH)))
    with pytest.raises(ValueError, match="one float dtype"):
        fwd(qkv, NH, dev64.empty((B, T, C), np.float32), lse)
    with pytest.raises(ValueError, match="limit of 128"):
        fwd(dev64.zeros((1, 2, 3 * 129)), 1, dev64.zeros((1, 2, 129)), dev64.zeros((1, 1, 2)))
    with pytest.raises(ValueError, match="tile 5"):
        fwd(qkv, NH, out, lse, tile=5)
    with pytest.raises(ValueError, match="work has shape"):
        bwd(out, qkv, out, lse, NH, dev64.zeros(qkv.shape), dev64.zeros((B, NH, T, T)))
    with pytest.raises(ValueError, match="dqkv has shape"):
        bwd(out, qkv, out, lse, NH, dev64.zeros((B, T, C)), lse)
    with pytest.raises(ValueError, match="dout has shape"):
        bwd(qkv, qkv, out, lse, NH, dev64.zeros(qkv.shape), lse)


@needs_cuda
@gpu
@pytest.mark.parametrize("B, T, NH, hs", [(4, 1024, 12, 64), (2, 512, 4, 128)])
def test_flash_gpt2_size_float32_within_bound_of_float64_twin(dev32, B, T, NH, hs):
    qkv, dout = inputs(B, T, NH, hs, seed=4)
    out_ref, dqkv_ref = twin_results(qkv, dout, NH)
    out, lse, (dqkv, dqkv_again) = run_flash(dev32, qkv, dout, NH, backward_runs=2)
    rel = float32_bound(qkv, NH)   # as the simulator test's bound
    assert_close_to_scale(out.astype(np.float64), out_ref, rel)
    assert_close_to_scale(lse.astype(np.float64), numpy_lse(qkv, NH), rel)
    assert_close_to_scale(dqkv.astype(np.float64), dqkv_ref, rel)
    np.testing.assert_array_equal(dqkv_again.view(np.uint32), dqkv.view(np.uint32))


@needs_cuda
@gpu
def test_flash_gpt2_size_float64_matches_twin(dev64):
    B, T, NH, hs = 2, 1024, 12, 64
    qkv, dout = inputs(B, T, NH, hs, seed=5)
    out_ref, dqkv_ref = twin_results(qkv, dout, NH)
    out, lse, (dqkv,) = run_flash(dev64, qkv, dout, NH)
    rel = 4 * (T + hs) * 2.0 ** -53   # sums of up to T * hs terms, as the simulator cases
    assert_close_to_scale(out, out_ref, rel)
    assert_close_to_scale(dqkv, dqkv_ref, rel)
    np.testing.assert_allclose(lse, numpy_lse(qkv, NH), rtol=1e-12, atol=1e-12)


# ---- CUDA: the GEMM path against the twin and the flash kernels --------------------------
def _device(dtype):
    try:
        return CudaDevice(dtype, 0, "auto", "gemm")
    except ConfigError as exc:  # a GPU without CuPy: the GEMM path has no cuBLAS to run on
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def gdev64():
    return _device("float64")


@pytest.fixture(scope="module")
def gdev32():
    return _device("float32")


def run_gemm(dev, qkv, dout, NH, budget=None, backward_runs=1, gemm=True):
    """(out, lse, [dqkv per backward run]) on dev: its op table's attention, or with ``budget``
    the GEMM path called directly with that chunk budget (bytes of the two score buffers)."""
    B, T, C3 = qkv.shape
    dt = np.dtype(dev.dtype)
    Q, DO = dev.from_host(qkv.astype(dt)), dev.from_host(dout.astype(dt))
    O, L = dev.from_host(np.full((B, T, C3 // 3), np.nan, dt)), dev.from_host(np.full((B, NH, T), np.nan, dt))
    gemms = dev.ops.attention_forward.__self__.gemm
    kw = dict(stream=dev.stream, scratch=dev.scratch, gemm=gemms, budget=budget)
    if budget is None:
        dev.ops.attention_forward(Q, NH, O, L)
    else:
        gemm_path.attention_forward_cuda_gemm(Q, NH, O, L, **kw)
    grads = []
    for _ in range(backward_runs):
        DQ, W = dev.from_host(np.full(qkv.shape, np.nan, dt)), dev.empty((B, NH, T))
        if budget is None:
            dev.ops.attention_backward(DO, Q, O, L, NH, DQ, W)
        else:
            gemm_path.attention_backward_cuda_gemm(DO, Q, O, L, NH, DQ, W, **kw)
        grads.append(dev.to_host(DQ))
    return dev.to_host(O), dev.to_host(L), grads


# (B, T, NH, hs, budget): T = 1; chunks along heads (B <= NH), along batch rows (B > NH), one
# head per call (a budget of one byte), ragged T; the op table's own path (budget None)
GEMM_CASES = [(1, 1, 1, 1, None), (2, 5, 3, 2, None), (3, 7, 2, 3, None), (3, 7, 2, 3, 1), (2, 9, 3, 4, 1)]


@needs_cuda
@pytest.mark.parametrize("B, T, NH, hs, budget", GEMM_CASES)
def test_gemm_float64_matches_twin_and_numpy_lse(gdev64, B, T, NH, hs, budget):
    # the same products as the twin's (its GEMMs keep P; these recompute it from lse in
    # backward): results differ by summation order and exp/log's last bit, at most ~T hs terms
    qkv, dout = inputs(B, T, NH, hs)
    out_ref, dqkv_ref = twin_results(qkv, dout, NH)
    out, lse, (dqkv,) = run_gemm(gdev64, qkv, dout, NH, budget)
    assert_close_to_scale(out, out_ref, 1e-12)
    assert_close_to_scale(dqkv, dqkv_ref, 1e-12)
    np.testing.assert_allclose(lse, numpy_lse(qkv, NH), rtol=1e-13, atol=1e-13)


@needs_cuda
def test_float32_within_bound_and_deterministic_and_the_flash_kernels_agree(gdev32):
    # the flash test's bound (the flash tests above): each result within about (T + hs (1 + max
    # scaled sum|q k|)) u of its scale, x4 for the chained steps; no atomics, so the bits repeat
    B, T, NH, hs = 2, 11, 3, 5
    qkv, dout = inputs(B, T, NH, hs, seed=3)
    out_ref, dqkv_ref = twin_results(qkv, dout, NH)
    out, lse, (dqkv, again) = run_gemm(gdev32, qkv, dout, NH, backward_runs=2)
    rel = float32_bound(qkv, NH)
    assert_close_to_scale(out.astype(np.float64), out_ref, rel)
    assert_close_to_scale(lse.astype(np.float64), numpy_lse(qkv, NH), rel)
    assert_close_to_scale(dqkv.astype(np.float64), dqkv_ref, rel)
    np.testing.assert_array_equal(again.view(np.uint32), dqkv.view(np.uint32))
    # the flash kernels keep the same lse: their backward runs from the GEMM forward's state
    dt = np.float32
    D = lambda a: gdev32.from_host(a.astype(dt))  # noqa: E731
    DQ = gdev32.from_host(np.zeros(qkv.shape, dt))
    flash.attention_backward_cuda(D(dout), D(qkv), D(out), D(lse), NH, DQ, gdev32.empty((B, NH, T)),
                                           stream=gdev32.stream)
    assert_close_to_scale(gdev32.to_host(DQ).astype(np.float64), dqkv_ref, rel)


@needs_cuda
def test_heads_wider_than_the_flash_kernels_take_the_gemms(gdev64):
    B, T, NH, hs = 1, 3, 1, 130   # the flash kernels compile head sizes up to 128
    qkv, dout = inputs(B, T, NH, hs, seed=6)
    out_ref, dqkv_ref = twin_results(qkv, dout, NH)
    out, _, (dqkv,) = run_gemm(gdev64, qkv, dout, NH)
    assert_close_to_scale(out, out_ref, 1e-12)
    assert_close_to_scale(dqkv, dqkv_ref, 1e-12)
    assert gdev64.ops.attention_max_head_size is None


@needs_cuda
def test_future_positions_change_nothing_before_them(gdev64):
    B, T, NH, hs, t = 2, 9, 2, 3, 4
    qkv, dout = inputs(B, T, NH, hs, seed=1)
    dout[:, t + 1:] = 0
    out, lse, (dqkv,) = run_gemm(gdev64, qkv, dout, NH)
    changed = qkv.copy()
    changed[:, t + 1:] = inputs(B, T, NH, hs, seed=2)[0][:, t + 1:]
    out2, lse2, (dqkv2,) = run_gemm(gdev64, changed, dout, NH)
    # masked scores are exactly 0 in P and dS, so rows <= t see the same products
    np.testing.assert_array_equal(out2[:, :t + 1], out[:, :t + 1])
    np.testing.assert_array_equal(lse2[..., :t + 1], lse[..., :t + 1])
    np.testing.assert_array_equal(dqkv[:, t + 1:], 0)


@needs_cuda
def test_auto_takes_the_gemms_for_long_sequences_on_cublas_and_wide_heads():
    choose = choice.choose
    assert choose("auto", 1024, 64, True) == "gemm"
    assert choose("auto", choice.AUTO_GEMM_MIN_T - 1, 64, True) == "flash"
    assert choose("auto", 1024, 64, False) == "flash"       # no cuBLAS: numba GEMMs would be slower
    assert choose("auto", 8, 129, False) == "gemm"          # beyond the flash kernels' head sizes
    assert choose("flash", 4096, 64, True) == "flash" and choose("gemm", 8, 8, False) == "gemm"
    with pytest.raises(ValueError, match="model.attention='fast'"):
        choose("fast", 8, 8, True)


@needs_cuda
def test_chunks_hold_as_many_heads_as_the_budget_allows_along_the_cheaper_axis():
    plan = gemm_path.chunk_plan
    assert plan(4, 12, 1024, 4) == ("heads", 12)             # 12 x 8 MiB = 96 MiB: 4 calls
    assert plan(16, 4, 128, 4) == ("rows", 16)              # 4 calls along rows, 16 along heads
    assert plan(1, 12, 4096, 4) == ("heads", 2)             # 128 MiB a head: two per 256 MiB
    assert plan(1, 1, 16384, 4) == ("heads", 1)             # one head alone past the budget
    chunks = list(gemm_path._chunks(3, 5, "heads", 2))
    assert chunks == [(b, h, n) for b in range(3) for h, n in ((0, 2), (2, 2), (4, 1))]


@needs_cuda
def test_gemm_attention_without_cublas_on_a_gpu_is_a_config_error(monkeypatch):
    import hpctrain.device.cuda as cuda_device

    monkeypatch.setattr(cuda_device, "simulated", lambda: False)   # as on a real GPU with train.gemm = numba
    with pytest.raises(ConfigError, match="model.attention='gemm' runs its GEMMs on cuBLAS"):
        CudaDevice("float32", 0, "numba", "gemm")
    auto = CudaDevice("float32", 0, "numba", "auto")           # auto: the flash kernels, their head limit
    assert auto.ops.attention_forward.__self__.gemm is None
    assert auto.ops.attention_max_head_size == flash.HS_SIZES[-1]


@needs_cuda
def test_the_start_up_check_passes_the_gemm_path_and_catches_a_wrong_argument(gdev32):
    """Run when a GPU device is made with cuBLAS's GEMMs (a CuPy whose binding reads arguments
    otherwise would train on wrong attention); here with NumPy's products, and with products
    whose scalar alpha is misread (as a value taken for a pointer would be)."""
    from dataclasses import replace

    from hpctrain.kernels.support.batched_gemm import HostBatchedGemm

    class MisreadAlpha(HostBatchedGemm):
        def __call__(self, g, a, b, c):
            return super().__call__(replace(g, alpha=0.5) if not (g.trans_a or g.trans_b) else g, a, b, c)

    small = (1, 2, 5, 2)
    assert gemm_path.self_check(HostBatchedGemm(), gdev32.stream, gdev32.scratch, np.float32, small) == ""
    why = gemm_path.self_check(MisreadAlpha(), gdev32.stream, gdev32.scratch, np.float32, small)
    assert "the cuBLAS attention's out differs from the flash kernels' by 5.0e-01" in why, why


@needs_cuda
def test_gemm_bad_shapes_raise(gdev64):
    B, T, NH, hs = 2, 5, 2, 3
    C = NH * hs
    qkv, out, lse = gdev64.zeros((B, T, 3 * C)), gdev64.zeros((B, T, C)), gdev64.zeros((B, NH, T))
    fwd, bwd = gdev64.ops.attention_forward, gdev64.ops.attention_backward
    with pytest.raises(ValueError, match="lse has shape"):
        fwd(qkv, NH, out, gdev64.zeros((B, T, NH)))
    with pytest.raises(ValueError, match="dqkv has shape"):
        bwd(out, qkv, out, lse, NH, gdev64.zeros((B, T, C)), lse)


@needs_cuda
@pytest.mark.gpu
def test_gemm_gpt2_size_float32_within_bound_of_float64_twin(gdev32):
    B, T, NH, hs = 4, 1024, 12, 64
    qkv, dout = inputs(B, T, NH, hs, seed=4)
    out_ref, dqkv_ref = twin_results(qkv, dout, NH)
    out, lse, (dqkv, again) = run_gemm(gdev32, qkv, dout, NH, backward_runs=2)
    rel = float32_bound(qkv, NH)
    assert_close_to_scale(out.astype(np.float64), out_ref, rel)
    assert_close_to_scale(lse.astype(np.float64), numpy_lse(qkv, NH), rel)
    assert_close_to_scale(dqkv.astype(np.float64), dqkv_ref, rel)
    np.testing.assert_array_equal(again.view(np.uint32), dqkv.view(np.uint32))

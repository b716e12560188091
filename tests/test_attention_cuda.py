"""Causal attention's CUDA kernels (hpctrain/kernels/attention_cuda*.py) against the CPU twin
(attention.py, itself checked against NumPy and finite differences in test_kernels.py).

Without a GPU these run on numba's CUDA simulator (every simulated thread is a
Python thread): B * NH <= 9, T <= 33 and the smallest tile (4) forced where a
case should span several tiles, so partial tiles, the online softmax's
rescaling and the skipped masked tiles are all exercised. The same checks at
GPT-2 size are marked ``gpu`` and run only on a real GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.device import cuda_status
from hpctrain.kernels import attention, attention_cuda

pytestmark = pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")

U32 = 2.0 ** -24
gpu = pytest.mark.gpu


def inputs(B, T, NH, hs, seed=0):
    """qkv (B, T, 3C) and dout (B, T, C), float64 values exactly representable in float32."""
    r = np.random.default_rng([4177, B, T, NH, hs, seed])
    C = NH * hs
    qkv = r.standard_normal((B, T, 3 * C)).astype(np.float32).astype(np.float64)
    return qkv, r.standard_normal((B, T, C)).astype(np.float32).astype(np.float64)


def twin(qkv, dout, NH):
    """(out, dqkv) of the CPU twin, in qkv's dtype."""
    B, T, C3 = qkv.shape
    out, probs, dqkv = np.empty((B, T, C3 // 3), qkv.dtype), np.empty((B, NH, T, T), qkv.dtype), np.empty_like(qkv)
    attention.attention_forward(qkv, NH, out, probs)
    attention.attention_backward(dout, qkv, out, probs, NH, dqkv)
    return out, dqkv


def run(dev, qkv, dout, NH, tile=None, backward_runs=1):
    """(out, lse, [dqkv per backward run]) of the kernels on dev, in dev's dtype."""
    B, T, C3 = qkv.shape
    lse_shape, work_shape = attention_cuda.attention_state_shapes(B, NH, T)
    dt = np.dtype(dev.dtype)
    Q, DO = dev.from_host(qkv.astype(dt), dt), dev.from_host(dout.astype(dt), dt)
    O, L = dev.from_host(np.full((B, T, C3 // 3), np.nan, dt), dt), dev.from_host(np.full(lse_shape, np.nan, dt), dt)
    attention_cuda.attention_forward_cuda(Q, NH, O, L, stream=dev.stream, tile=tile)
    grads = []
    for _ in range(backward_runs):
        # NaN-filled: an element the kernels fail to write shows up
        DQ, W = dev.from_host(np.full(qkv.shape, np.nan, dt), dt), dev.empty(work_shape)
        attention_cuda.attention_backward_cuda(DO, Q, O, L, NH, DQ, W, stream=dev.stream, tile=tile)
        grads.append(dev.to_host(DQ))
    return dev.to_host(O), dev.to_host(L), grads


def numpy_lse(qkv, NH):
    """(B, NH, T) log-sum-exp of each row's scaled, masked scores, in float64."""
    q, k = (attention._qkv_heads(qkv, NH, i) for i in range(2))
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
    q, k = (np.abs(attention._qkv_heads(qkv, NH, i)) for i in range(2))
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
CASES = [(1, 1, 1, 1, 4), (2, 5, 2, 3, 4), (1, 33, 1, 5, 4), (1, 7, 3, 1, None)]


@pytest.mark.parametrize("B, T, NH, hs, tile", CASES)
def test_float64_matches_twin_and_numpy_lse(dev64, B, T, NH, hs, tile):
    # float64: the only differences from the twin are summation order, exp/log's last bit and
    # D = rowsum(dO * O) in place of rowsum(dP * P): each result is a sum of at most ~T * hs
    # terms, so about T * hs * 2^-53 (~2e-14 at T=33, hs=5) of its scale; 1e-12 leaves 50x margin
    qkv, dout = inputs(B, T, NH, hs)
    out_ref, dqkv_ref = twin(qkv, dout, NH)
    out, lse, (dqkv,) = run(dev64, qkv, dout, NH, tile)
    assert_close_to_scale(out, out_ref, 1e-12)
    assert_close_to_scale(dqkv, dqkv_ref, 1e-12)
    np.testing.assert_allclose(lse, numpy_lse(qkv, NH), rtol=1e-13, atol=1e-13)


def test_causal_future_positions_change_nothing_before_them(dev64):
    B, T, NH, hs, t = 1, 11, 2, 3, 5
    qkv, dout = inputs(B, T, NH, hs, seed=1)
    dout[:, t + 1:] = 0
    out, lse, (dqkv,) = run(dev64, qkv, dout, NH, tile=4)
    changed = qkv.copy()
    changed[:, t + 1:] = inputs(B, T, NH, hs, seed=2)[0][:, t + 1:]  # new q, k, v after t
    out2, lse2, (dqkv2,) = run(dev64, changed, dout, NH, tile=4)
    # masked scores are exactly exp(-inf) = 0, so rows <= t are bitwise the same
    np.testing.assert_array_equal(out2[:, :t + 1], out[:, :t + 1])
    np.testing.assert_array_equal(lse2[..., :t + 1], lse[..., :t + 1])
    np.testing.assert_array_equal(dqkv2[:, :t + 1], dqkv[:, :t + 1])
    # dout is zero after t: nothing reaches q, k, v after t (dV, dP and D vanish there)
    np.testing.assert_array_equal(dqkv[:, t + 1:], 0)
    assert np.any(out2[:, t + 1:] != out[:, t + 1:])  # the change did reach the later rows


def test_float32_within_bound_of_float64_and_deterministic(dev32):
    # Inputs are float32-exact, so all error is the kernels' float32 arithmetic. A score is an
    # hs-term dot (error <= hs u sum|q k| scale, which exp turns into a relative error of P);
    # lse, out and the gradients add sums of up to T terms of P-weighted rows. So each result is
    # within about (T + hs (1 + max scaled sum|q k|)) u of its scale; factor 4 for the few
    # chained steps (exp, D's dot, dS's difference). Measured: 45-170x below the bound.
    B, T, NH, hs = 1, 18, 2, 5   # five tiles of 4, two rows in the last
    qkv, dout = inputs(B, T, NH, hs, seed=3)
    out_ref, dqkv_ref = twin(qkv, dout, NH)
    out, lse, (dqkv, dqkv_again) = run(dev32, qkv, dout, NH, tile=4, backward_runs=2)
    rel = float32_bound(qkv, NH)
    assert_close_to_scale(out.astype(np.float64), out_ref, rel)
    assert_close_to_scale(lse.astype(np.float64), numpy_lse(qkv, NH), rel)
    assert_close_to_scale(dqkv.astype(np.float64), dqkv_ref, rel)
    # no atomics: each element is summed by one thread in a fixed order, so the bits repeat
    np.testing.assert_array_equal(dqkv_again.view(np.uint32), dqkv.view(np.uint32))


def test_tile_choice_follows_shared_memory_and_T():
    choose = attention_cuda.choose_tile
    assert choose("forward", np.float32, 64, 1024) == 32     # Q, K, V of 32 x 65 float32: 29 KiB
    assert choose("forward", np.float32, 128, 1024) == 16    # at 32: 54 KiB, over the limit
    assert choose("backward_dkv", np.float64, 128, 1024) == 8
    assert choose("forward", np.float32, 64, 7) == 8          # no larger than T's power of two
    assert choose("forward", np.float32, 64, 1) == 4
    for kind in ("forward", "backward_dkv", "backward_dq"):
        for dt in (np.float32, np.float64):
            for hs in (1, 32, 33, 64, 65, 128):
                t = choose(kind, dt, hs, 4096)
                assert attention_cuda._smem_bytes(kind, t, attention_cuda.hs_capacity(hs),
                                                  np.dtype(dt).itemsize) <= attention_cuda.SMEM_LIMIT
    with pytest.raises(ValueError, match="limit of 128"):
        choose("forward", np.float32, 129, 64)


def test_bad_shapes_raise(dev64):
    B, T, NH, hs = 2, 5, 2, 3
    C = NH * hs
    qkv, out, lse = dev64.zeros((B, T, 3 * C)), dev64.zeros((B, T, C)), dev64.zeros((B, NH, T))
    fwd, bwd = attention_cuda.attention_forward_cuda, attention_cuda.attention_backward_cuda
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


# ---- GPT-2 size, real GPU only ------------------------------------------------------
@gpu
@pytest.mark.parametrize("B, T, NH, hs", [(4, 1024, 12, 64), (2, 512, 4, 128)])
def test_gpt2_size_float32_within_bound_of_float64_twin(dev32, B, T, NH, hs):
    qkv, dout = inputs(B, T, NH, hs, seed=4)
    out_ref, dqkv_ref = twin(qkv, dout, NH)
    out, lse, (dqkv, dqkv_again) = run(dev32, qkv, dout, NH, backward_runs=2)
    rel = float32_bound(qkv, NH)   # as the simulator test's bound
    assert_close_to_scale(out.astype(np.float64), out_ref, rel)
    assert_close_to_scale(lse.astype(np.float64), numpy_lse(qkv, NH), rel)
    assert_close_to_scale(dqkv.astype(np.float64), dqkv_ref, rel)
    np.testing.assert_array_equal(dqkv_again.view(np.uint32), dqkv.view(np.uint32))


@gpu
def test_gpt2_size_float64_matches_twin(dev64):
    B, T, NH, hs = 2, 1024, 12, 64
    qkv, dout = inputs(B, T, NH, hs, seed=5)
    out_ref, dqkv_ref = twin(qkv, dout, NH)
    out, lse, (dqkv,) = run(dev64, qkv, dout, NH)
    rel = 4 * (T + hs) * 2.0 ** -53   # sums of up to T * hs terms, as the simulator cases
    assert_close_to_scale(out, out_ref, rel)
    assert_close_to_scale(dqkv, dqkv_ref, rel)
    np.testing.assert_allclose(lse, numpy_lse(qkv, NH), rtol=1e-12, atol=1e-12)

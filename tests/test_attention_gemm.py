"""Causal attention as batched GEMMs around softmax kernels (hpctrain/kernels/attention_gemm.py,
``model.attention = gemm``) against the CPU twin (attention.py) and the flash kernels.

On the numba simulator the GEMMs are NumPy's on the same device buffers (HostBatchedGemm) and
the softmax kernels run simulated; on a GPU (scripts/cuda-tests.txt) the same tests run the
GEMMs on cuBLAS. The device is built with ``model.attention = gemm``, so the op table's
own path is what is tested, and a chunk budget of one head forces one GEMM call per head.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.device import CudaDevice, cuda_status
from hpctrain.errors import ConfigError
from hpctrain.kernels import attention_cuda, attention_gemm

from test_attention_cuda import assert_close_to_scale, float32_bound, inputs, numpy_lse, twin

pytestmark = pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")


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


def run(dev, qkv, dout, NH, budget=None, backward_runs=1, gemm=True):
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
        attention_gemm.attention_forward_gemm(Q, NH, O, L, **kw)
    grads = []
    for _ in range(backward_runs):
        DQ, W = dev.from_host(np.full(qkv.shape, np.nan, dt)), dev.empty((B, NH, T))
        if budget is None:
            dev.ops.attention_backward(DO, Q, O, L, NH, DQ, W)
        else:
            attention_gemm.attention_backward_gemm(DO, Q, O, L, NH, DQ, W, **kw)
        grads.append(dev.to_host(DQ))
    return dev.to_host(O), dev.to_host(L), grads


# (B, T, NH, hs, budget): T = 1; chunks along heads (B <= NH), along batch rows (B > NH), one
# head per call (a budget of one byte), ragged T; the op table's own path (budget None)
CASES = [(1, 1, 1, 1, None), (2, 5, 3, 2, None), (3, 7, 2, 3, None), (3, 7, 2, 3, 1), (2, 9, 3, 4, 1)]


@pytest.mark.parametrize("B, T, NH, hs, budget", CASES)
def test_float64_matches_twin_and_numpy_lse(gdev64, B, T, NH, hs, budget):
    # the same products as the twin's (its GEMMs keep P; these recompute it from lse in
    # backward): results differ by summation order and exp/log's last bit, at most ~T hs terms
    qkv, dout = inputs(B, T, NH, hs)
    out_ref, dqkv_ref = twin(qkv, dout, NH)
    out, lse, (dqkv,) = run(gdev64, qkv, dout, NH, budget)
    assert_close_to_scale(out, out_ref, 1e-12)
    assert_close_to_scale(dqkv, dqkv_ref, 1e-12)
    np.testing.assert_allclose(lse, numpy_lse(qkv, NH), rtol=1e-13, atol=1e-13)


def test_float32_within_bound_and_deterministic_and_the_flash_kernels_agree(gdev32):
    # the flash test's bound (test_attention_cuda): each result within about (T + hs (1 + max
    # scaled sum|q k|)) u of its scale, x4 for the chained steps; no atomics, so the bits repeat
    B, T, NH, hs = 2, 11, 3, 5
    qkv, dout = inputs(B, T, NH, hs, seed=3)
    out_ref, dqkv_ref = twin(qkv, dout, NH)
    out, lse, (dqkv, again) = run(gdev32, qkv, dout, NH, backward_runs=2)
    rel = float32_bound(qkv, NH)
    assert_close_to_scale(out.astype(np.float64), out_ref, rel)
    assert_close_to_scale(lse.astype(np.float64), numpy_lse(qkv, NH), rel)
    assert_close_to_scale(dqkv.astype(np.float64), dqkv_ref, rel)
    np.testing.assert_array_equal(again.view(np.uint32), dqkv.view(np.uint32))
    # the flash kernels keep the same lse: their backward runs from the GEMM forward's state
    dt = np.float32
    D = lambda a: gdev32.from_host(a.astype(dt))  # noqa: E731
    DQ = gdev32.from_host(np.zeros(qkv.shape, dt))
    attention_cuda.attention_backward_cuda(D(dout), D(qkv), D(out), D(lse), NH, DQ, gdev32.empty((B, NH, T)),
                                           stream=gdev32.stream)
    assert_close_to_scale(gdev32.to_host(DQ).astype(np.float64), dqkv_ref, rel)


def test_heads_wider_than_the_flash_kernels_take_the_gemms(gdev64):
    B, T, NH, hs = 1, 3, 1, 130   # the flash kernels compile head sizes up to 128
    qkv, dout = inputs(B, T, NH, hs, seed=6)
    out_ref, dqkv_ref = twin(qkv, dout, NH)
    out, _, (dqkv,) = run(gdev64, qkv, dout, NH)
    assert_close_to_scale(out, out_ref, 1e-12)
    assert_close_to_scale(dqkv, dqkv_ref, 1e-12)
    assert gdev64.ops.attention_max_head_size is None


def test_future_positions_change_nothing_before_them(gdev64):
    B, T, NH, hs, t = 2, 9, 2, 3, 4
    qkv, dout = inputs(B, T, NH, hs, seed=1)
    dout[:, t + 1:] = 0
    out, lse, (dqkv,) = run(gdev64, qkv, dout, NH)
    changed = qkv.copy()
    changed[:, t + 1:] = inputs(B, T, NH, hs, seed=2)[0][:, t + 1:]
    out2, lse2, (dqkv2,) = run(gdev64, changed, dout, NH)
    # masked scores are exactly 0 in P and dS, so rows <= t see the same products
    np.testing.assert_array_equal(out2[:, :t + 1], out[:, :t + 1])
    np.testing.assert_array_equal(lse2[..., :t + 1], lse[..., :t + 1])
    np.testing.assert_array_equal(dqkv[:, t + 1:], 0)


def test_auto_takes_the_gemms_for_long_sequences_on_cublas_and_wide_heads():
    choose = attention_gemm.choose
    assert choose("auto", 1024, 64, True) == "gemm"
    assert choose("auto", attention_gemm.AUTO_GEMM_MIN_T - 1, 64, True) == "flash"
    assert choose("auto", 1024, 64, False) == "flash"       # no cuBLAS: numba GEMMs would be slower
    assert choose("auto", 8, 129, False) == "gemm"          # beyond the flash kernels' head sizes
    assert choose("flash", 4096, 64, True) == "flash" and choose("gemm", 8, 8, False) == "gemm"
    with pytest.raises(ValueError, match="model.attention='fast'"):
        choose("fast", 8, 8, True)


def test_chunks_hold_as_many_heads_as_the_budget_allows_along_the_cheaper_axis():
    plan = attention_gemm.chunk_plan
    assert plan(4, 12, 1024, 4) == ("heads", 12)             # 12 x 8 MiB = 96 MiB: 4 calls
    assert plan(16, 4, 128, 4) == ("rows", 16)              # 4 calls along rows, 16 along heads
    assert plan(1, 12, 4096, 4) == ("heads", 2)             # 128 MiB a head: two per 256 MiB
    assert plan(1, 1, 16384, 4) == ("heads", 1)             # one head alone past the budget
    chunks = list(attention_gemm._chunks(3, 5, "heads", 2))
    assert chunks == [(b, h, n) for b in range(3) for h, n in ((0, 2), (2, 2), (4, 1))]


def test_gemm_attention_without_cublas_on_a_gpu_is_a_config_error(monkeypatch):
    import hpctrain.device.cuda as cuda_device

    monkeypatch.setattr(cuda_device, "simulated", lambda: False)   # as on a real GPU with train.gemm = numba
    with pytest.raises(ConfigError, match="model.attention='gemm' runs its GEMMs on cuBLAS"):
        CudaDevice("float32", 0, "numba", "gemm")
    auto = CudaDevice("float32", 0, "numba", "auto")           # auto: the flash kernels, their head limit
    assert auto.ops.attention_forward.__self__.gemm is None
    assert auto.ops.attention_max_head_size == attention_cuda.HS_SIZES[-1]


def test_the_start_up_check_passes_the_gemm_path_and_catches_a_wrong_argument(gdev32):
    """Run when a GPU device is made with cuBLAS's GEMMs (a CuPy whose binding reads arguments
    otherwise would train on wrong attention); here with NumPy's products, and with products
    whose scalar alpha is misread (as a value taken for a pointer would be)."""
    from dataclasses import replace

    from hpctrain.kernels.batched_gemm import HostBatchedGemm

    class MisreadAlpha(HostBatchedGemm):
        def __call__(self, g, a, b, c):
            return super().__call__(replace(g, alpha=0.5) if not (g.trans_a or g.trans_b) else g, a, b, c)

    small = (1, 2, 5, 2)
    assert attention_gemm.self_check(HostBatchedGemm(), gdev32.stream, gdev32.scratch, np.float32, small) == ""
    why = attention_gemm.self_check(MisreadAlpha(), gdev32.stream, gdev32.scratch, np.float32, small)
    assert "the cuBLAS attention's out differs from the flash kernels' by 5.0e-01" in why, why


def test_bad_shapes_raise(gdev64):
    B, T, NH, hs = 2, 5, 2, 3
    C = NH * hs
    qkv, out, lse = gdev64.zeros((B, T, 3 * C)), gdev64.zeros((B, T, C)), gdev64.zeros((B, NH, T))
    fwd, bwd = gdev64.ops.attention_forward, gdev64.ops.attention_backward
    with pytest.raises(ValueError, match="lse has shape"):
        fwd(qkv, NH, out, gdev64.zeros((B, T, NH)))
    with pytest.raises(ValueError, match="dqkv has shape"):
        bwd(out, qkv, out, lse, NH, gdev64.zeros((B, T, C)), lse)


# ---- GPT-2 size, real GPU only --------------------------------------------------------
@pytest.mark.gpu
def test_gpt2_size_float32_within_bound_of_float64_twin(gdev32):
    B, T, NH, hs = 4, 1024, 12, 64
    qkv, dout = inputs(B, T, NH, hs, seed=4)
    out_ref, dqkv_ref = twin(qkv, dout, NH)
    out, lse, (dqkv, again) = run(gdev32, qkv, dout, NH, backward_runs=2)
    rel = float32_bound(qkv, NH)
    assert_close_to_scale(out.astype(np.float64), out_ref, rel)
    assert_close_to_scale(lse.astype(np.float64), numpy_lse(qkv, NH), rel)
    assert_close_to_scale(dqkv.astype(np.float64), dqkv_ref, rel)
    np.testing.assert_array_equal(again.view(np.uint32), dqkv.view(np.uint32))

"""CPU ops split over threads (hpctrain/kernels/support/cpu_threads.py): the same bits at 1, 2 and 3 threads.

Every op the GPT and the MLP run on the CPU is computed with its rows split over 1, 2 and 3
threads (the split forced even for these small arrays: MIN_SPLIT_NS = 0) and must give the same
bytes each time, on row counts that leave the last chunk of CHUNK_ROWS rows and the last thread's
share ragged; and the split results must still match a float64 NumPy reference. A whole GPT
forward and backward must give the same loss and gradient bytes at 1 and 2 threads.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpctrain.kernels import adamw, attention, bias_act, layernorm, residual, sgd, softmax_xent
from hpctrain.kernels.support import cpu_threads

THREADS = (1, 2, 3)


@pytest.fixture(autouse=True)
def split_everything(monkeypatch):
    monkeypatch.setattr(cpu_threads, "MIN_SPLIT_NS", 0)
    yield
    cpu_threads.set_threads(None)


def _at_each_thread_count(run):
    """[run() at 1, 2, 3 threads]; run returns a tuple of arrays (copied)."""
    out = []
    for n in THREADS:
        cpu_threads.set_threads(n)
        out.append([np.array(a, copy=True) for a in run()])
    return out


def _same_bits(results):
    first = results[0]
    for n, other in zip(THREADS[1:], results[1:]):
        for i, (a, b) in enumerate(zip(first, other)):
            assert a.tobytes() == b.tobytes(), f"output {i} differs at {n} threads from 1 thread"


def _rng():
    return np.random.default_rng(7)


def test_ranges_cover_the_rows_in_order_with_sizes_differing_by_one_at_most():
    for n, parts in ((10, 3), (2, 5), (0, 2), (129, 2)):
        r = cpu_threads.ranges(n, parts)
        assert [lo for lo, _ in r] == [0] + [hi for _, hi in r[:-1]] and (r[-1][1] if r else 0) == n
        sizes = [hi - lo for lo, hi in r]
        assert max(sizes, default=0) - min(sizes, default=0) <= 1 and len(r) <= max(1, min(parts, n))


def test_a_thread_that_raises_raises_in_the_caller_after_the_others_finish():
    cpu_threads.set_threads(3)
    done = []

    def fn(lo, hi):
        if lo > 0:
            raise ValueError(f"rows {lo}:{hi}")
        done.append((lo, hi))
    with pytest.raises(ValueError, match="rows"):
        cpu_threads.for_rows(fn, 9, 9)
    assert done == [(0, 3)]


def test_an_op_is_split_only_when_its_time_on_one_core_pays_for_the_hand_off(monkeypatch):
    monkeypatch.setattr(cpu_threads, "MIN_SPLIT_NS", 1000)
    cpu_threads.set_threads(2)
    for elements, ns, parts in ((999, 1.0, 1), (1000, 1.0, 2), (4000, 0.2, 1), (4000, 0.25, 2)):
        seen = []
        cpu_threads.for_rows(lambda lo, hi: seen.append((lo, hi)), 10, elements, ns_per_element=ns)
        assert sorted(seen) == ([(0, 10)] if parts == 1 else [(0, 5), (5, 10)]), (elements, ns)


def test_chunk_ranges_cover_every_chunk_once_in_one_call_per_thread():
    cpu_threads.set_threads(3)
    seen = []
    chunks = cpu_threads.for_chunks(lambda c0, c1: seen.append((c0, c1)), 5 * cpu_threads.CHUNK_ROWS + 1, 10 ** 9)
    assert chunks == 6 and sorted(seen) == [(0, 2), (2, 4), (4, 6)]



def test_the_thread_count_is_read_from_the_environment_once_until_reset(monkeypatch):
    """An op does not read the environment: the count is resolved at the first op (OMP_NUM_THREADS,
    which the entry point's limit_threads_per_rank sets first) and kept; set_threads(None) resets it,
    and the next op resolves it anew."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cpu_threads.set_threads(None)
    assert cpu_threads.threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads.threads() == 3              # resolved once: a later change is not read per op
    cpu_threads.set_threads(5)
    assert cpu_threads.threads() == 5              # set_threads wins
    cpu_threads.set_threads(None)
    assert cpu_threads.threads() == 2              # reset: resolved anew from the environment
    monkeypatch.delenv("OMP_NUM_THREADS")
    cpu_threads.set_threads(None)
    assert cpu_threads.threads() == len(cpu_threads.cpus())   # without it, the cores this process may use


@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
def test_bias_act_same_bits_at_any_thread_count(act):
    r = _rng()
    B, O = 300, 37   # 3 chunks of 128 rows, the last ragged
    z0, b, dout = (r.standard_normal(s).astype(np.float32) for s in ((B, O), (O,), (B, O)))
    db0 = r.standard_normal(O).astype(np.float32)

    def run():
        z, out, dz, db = z0.copy(), np.empty((B, O), np.float32), np.empty((B, O), np.float32), db0.copy()
        bias_act.bias_act_forward(z, b, out, act)
        bias_act.bias_act_backward(dout, z, dz, db, act, accumulate=True)
        return z, out, dz, db
    results = _at_each_thread_count(run)
    _same_bits(results)
    z, out, dz, db = results[-1]
    np.testing.assert_allclose(z, z0.astype(np.float64) + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(db, db0 + dz.astype(np.float64).sum(0), rtol=1e-5, atol=1e-4)


def test_layernorm_same_bits_at_any_thread_count():
    r = _rng()
    N, C = 261, 24
    x, w, bias, dout, a = (r.standard_normal(s).astype(np.float32) for s in ((N, C), (C,), (C,), (N, C), (N, C)))

    def run():
        out, mean, rstd = np.empty((N, C), np.float32), np.empty(N, np.float32), np.empty(N, np.float32)
        xs = np.empty((N, C), np.float32)
        layernorm.residual_layernorm_forward(x, a, xs, w, bias, out, mean, rstd)
        dx, dw, db = np.ones((N, C), np.float32), np.zeros(C, np.float32), np.zeros(C, np.float32)
        layernorm.layernorm_backward(dout, xs, w, mean, rstd, dx, dw, db, accumulate=True, add_dx=True)
        return out, mean, rstd, dx, dw, db
    results = _at_each_thread_count(run)
    _same_bits(results)
    out, _, _, _, dw, db = results[-1]
    with pytest.raises(ValueError, match="residual_layernorm_forward: b is float32 \\(1, 24\\)"):
        layernorm.residual_layernorm_forward(x, a[:1], np.empty((N, C), np.float32), w, bias, out,
                                             np.empty(N, np.float32), np.empty(N, np.float32))
    xs = x.astype(np.float64) + a
    xhat = (xs - xs.mean(1, keepdims=True)) / np.sqrt(xs.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, xhat * w + bias, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, dout.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, (dout * xhat).sum(0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_softmax_xent_same_bits_at_any_thread_count(fused):
    r = _rng()
    B, C = 290, 13
    logits = (3 * r.standard_normal((B, C))).astype(np.float32)
    labels = r.integers(0, C, B)

    def run():
        out = np.empty((B, C), np.float32)
        if fused:
            loss, correct = softmax_xent.softmax_xent_fused(logits, labels, 1.0 / B, out)
        else:
            loss, correct = softmax_xent.softmax_xent_forward(logits, labels, out)
            softmax_xent.softmax_xent_backward(out.copy(), labels, 1.0 / B, out)
        return out, np.array([loss, correct])
    results = _at_each_thread_count(run)
    _same_bits(results)
    l64 = logits.astype(np.float64)
    lse = np.log(np.exp(l64 - l64.max(1, keepdims=True)).sum(1)) + l64.max(1)
    want = (lse - l64[np.arange(B), labels]).sum()
    assert math.isclose(results[-1][1][0], want, rel_tol=1e-6)
    assert results[-1][1][1] == (logits.argmax(1) == labels).sum()


def test_attention_same_bits_at_any_thread_count():
    r = _rng()
    B, T, C, NH = 5, 9, 12, 3   # 5 batch rows over 2 and 3 threads: ragged shares
    qkv, dout = r.standard_normal((B, T, 3 * C)).astype(np.float32), r.standard_normal((B, T, C)).astype(np.float32)

    def run():
        out, probs = np.empty((B, T, C), np.float32), np.empty((B, NH, T, T), np.float32)
        attention.attention_forward(qkv, NH, out, probs)
        dqkv = np.empty_like(qkv)
        attention.attention_backward(dout, qkv, out, probs, NH, dqkv)
        return out, probs, dqkv
    results = _at_each_thread_count(run)
    _same_bits(results)
    out = results[-1][0]
    q, k, v = (qkv.astype(np.float64).reshape(B, T, 3, NH, C // NH)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.swapaxes(-1, -2) / math.sqrt(C // NH) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = ((p / p.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_residual_and_optimizers_same_bits_at_any_thread_count():
    r = _rng()
    n = 1001
    a, b, g, p0, m0 = (r.standard_normal(n).astype(np.float32) for _ in range(5))
    v0 = r.random(n).astype(np.float32)
    hyper_a = adamw.hyperparameters(np.float32, 3, 1e-2, 0.9, 0.99, 1e-8, 0.1)
    hyper_s = sgd.hyperparameters(np.float32, 1e-2, 0.9, 0.1)

    def run():
        out, da, db = np.empty(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
        residual.residual_forward(a, b, out)
        residual.residual_backward(g, da, db, accumulate=False)
        pa, m, v, ps, mom = p0.copy(), m0.copy(), v0.copy(), p0.copy(), m0.copy()
        adamw.adamw_update(pa, g, m, v, hyper_a)
        sgd.sgd_update(ps, g, mom, hyper_s, True)
        return out, da, db, pa, m, v, ps, mom
    results = _at_each_thread_count(run)
    _same_bits(results)
    np.testing.assert_array_equal(results[-1][0], a + b)


def test_a_gpt_step_gives_the_same_bits_at_one_and_two_threads():
    from hpctrain.device import CpuDevice
    from hpctrain.models.gpt import GPT

    r = _rng()
    x, y = r.integers(0, 29, (9, 32)), r.integers(0, 29, (9, 32))   # 288 rows: three chunks, the last ragged

    def run():
        model = GPT(CpuDevice("float32"), 29, 32, 2, 2, 16)
        model.init(3)
        loss, correct = model.forward(x, y)
        model.backward()
        return np.array([loss, correct]), model.flat.grad
    results = []
    for n in (1, 2):
        cpu_threads.set_threads(n)
        results.append([np.array(a, copy=True) for a in run()])
    for a, b in zip(*results):
        assert a.tobytes() == b.tobytes()

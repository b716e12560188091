"""CPU twins of the GPT ops (embedding, layernorm, attention, residual).

Forward passes against float64 NumPy references written here from the
formulas (fancy indexing, einsum); backward passes against central finite
differences in float64 of sum(out * R) for a fixed random R, perturbing every
input element (fd_grad, FD_TOL and their justification: tests/test_kernels.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpctrain.device import CPU_OPS
from hpctrain.kernels.attention import attention_backward, attention_forward
from hpctrain.kernels.embedding import embedding_backward, embedding_forward
from hpctrain.kernels.layernorm import layernorm_backward, layernorm_forward
from hpctrain.kernels.residual import residual_backward, residual_forward
from test_kernels import FD_TOL, U32, fd_grad, rng_for

DTYPES = [np.float32, np.float64]


# ---- references (float64) ----------------------------------------------------------
def embedding_ref(tokens, wte, wpe):
    return wte.astype(np.float64)[tokens] + wpe.astype(np.float64)[:tokens.shape[1]]


def layernorm_ref(x, w, b, eps=1e-5):
    x = x.astype(np.float64)
    mean, var = x.mean(axis=1), x.var(axis=1)  # biased variance, as PyTorch
    rstd = 1.0 / np.sqrt(var + eps)
    return (x - mean[:, None]) * rstd[:, None] * w + b, mean, rstd


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


# ---- embedding ---------------------------------------------------------------------
EMB_SHAPES = [(1, 1, 1, 1, 1), (2, 3, 5, 4, 3), (3, 5, 4, 7, 6)]  # (B, T, V, Tmax, C)


def embedding_data(shape, dtype=np.float64, key=0):
    B, T, V, Tmax, C = shape
    r = rng_for(30, key, *shape)
    tokens = r.integers(0, V, size=(B, T))  # V < B*T: most shapes repeat tokens
    return tokens, r.standard_normal((V, C)).astype(dtype), r.standard_normal((Tmax, C)).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", EMB_SHAPES)
def test_embedding_forward_matches_reference(shape, dtype):
    tokens, wte, wpe = embedding_data(shape, dtype)
    out = np.full((*tokens.shape, wte.shape[1]), np.nan, dtype)
    assert embedding_forward(tokens, wte, wpe, out) is out
    # one correctly rounded addition per element: equal to NumPy's bit for bit
    np.testing.assert_array_equal(out, wte[tokens] + wpe[:tokens.shape[1]])
    np.testing.assert_allclose(out, embedding_ref(tokens, wte, wpe), rtol=U32 if dtype == np.float32 else 1e-16)


def test_embedding_forward_accepts_int32_tokens_and_rejects_bad_ones():
    tokens, wte, wpe = embedding_data((2, 3, 5, 4, 3))
    out = np.empty((2, 3, 3))
    embedding_forward(tokens.astype(np.int32), wte, wpe, out)
    np.testing.assert_array_equal(out, embedding_ref(tokens, wte, wpe))
    for bad in (-1, 5):
        t = tokens.copy()
        t[1, 2] = bad
        with pytest.raises(ValueError, match=r"token id .* at \(b=1, t=2\)"):
            embedding_forward(t, wte, wpe, out)
        with pytest.raises(ValueError, match="vocabulary"):
            embedding_backward(out, t, np.zeros_like(wte), np.zeros_like(wpe))
    with pytest.raises(ValueError, match="context"):
        embedding_forward(np.zeros((1, 5), np.int64), wte, wpe, np.empty((1, 5, 3)))


@pytest.mark.parametrize("shape", EMB_SHAPES)
def test_embedding_backward_matches_finite_differences(shape):
    tokens, wte, wpe = embedding_data(shape)
    B, T, V, Tmax, C = shape
    R = rng_for(31, *shape).standard_normal((B, T, C))
    out = np.empty((B, T, C))

    def terms():
        return embedding_forward(tokens, wte, wpe, out) * R

    dwte, dwpe = np.zeros((V, C)), np.full((Tmax, C), np.nan)  # dwte always accumulates
    assert embedding_backward(R, tokens, dwte, dwpe) is None
    np.testing.assert_allclose(dwte, fd_grad(terms, wte), **FD_TOL)
    np.testing.assert_allclose(dwpe, fd_grad(terms, wpe), **FD_TOL)
    assert np.all(dwpe[T:] == 0)  # positions past T got no gradient


@pytest.mark.parametrize("accumulate", [False, True])
def test_embedding_backward_flags(accumulate):
    # dwte adds to what the tied LM head wrote either way; dwpe adds only with accumulate
    tokens, _, _ = embedding_data((3, 5, 4, 7, 6))
    r = rng_for(32)
    dout, dwte0, dwpe0 = r.standard_normal((3, 5, 6)), r.standard_normal((4, 6)), r.standard_normal((7, 6))
    base_te, base_pe = np.zeros((4, 6)), np.zeros((7, 6))
    embedding_backward(dout, tokens, base_te, base_pe)
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    embedding_backward(dout, tokens, dwte, dwpe, accumulate=accumulate)
    np.testing.assert_allclose(dwte, dwte0 + base_te, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(dwpe, dwpe0 + base_pe if accumulate else base_pe, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_backward_repeated_tokens_deterministic(dtype):
    B, T, V, C = 8, 64, 5, 16  # 512 positions on 5 tokens: ~100 rows added per token
    r = rng_for(33)
    tokens = r.integers(0, V, size=(B, T))
    dout = r.standard_normal((B, T, C)).astype(dtype)
    runs = []
    for _ in range(3):
        dwte, dwpe = np.zeros((V, C), dtype), np.zeros((T, C), dtype)
        embedding_backward(dout, tokens, dwte, dwpe)
        runs.append(dwte.view(np.uint32 if dtype == np.float32 else np.uint64).copy())
    assert all(np.array_equal(runs[0], x) for x in runs[1:])  # the same bits every time
    ref, mag = np.zeros((V, C)), np.zeros((V, C))
    np.add.at(ref, tokens.ravel(), dout.reshape(-1, C).astype(np.float64))
    np.add.at(mag, tokens.ravel(), np.abs(dout.reshape(-1, C).astype(np.float64)))
    # a serial sum of n terms in float32 is within (n-1) u sum|terms| of the
    # exact sum (u = 2^-24); float64 adds ~1e-16 relative to the same sum
    n = np.bincount(tokens.ravel(), minlength=V).max()
    u = U32 if dtype == np.float32 else 2.0 ** -53
    assert np.all(np.abs(dwte.astype(np.float64) - ref) <= n * u * mag)


# ---- layernorm ---------------------------------------------------------------------
LN_SHAPES = [(1, 1), (1, 5), (3, 7), (6, 12)]  # (N, C): one row, one channel, C not a power of two


def layernorm_data(shape, dtype=np.float64, offset=0.0, scale=1.0):
    N, C = shape
    r = rng_for(40, *shape)
    x = offset + scale * r.standard_normal((N, C))
    return x.astype(dtype), (1 + 0.3 * r.standard_normal(C)).astype(dtype), r.standard_normal(C).astype(dtype)


def run_layernorm(x, w, b):
    N, C = x.shape
    out, mean, rstd = np.full((N, C), np.nan, x.dtype), np.empty(N, x.dtype), np.empty(N, x.dtype)
    assert layernorm_forward(x, w, b, out, mean, rstd) is out
    return out, mean, rstd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm_forward_matches_reference(shape, dtype):
    x, w, b = layernorm_data(shape, dtype)
    out, mean, rstd = run_layernorm(x, w, b)
    ref = layernorm_ref(x, w, b)
    # The twin computes in float64 and rounds each stored value once (<= u
    # relative, u = 2^-24 in float32); 2u leaves room for the reference's own
    # ~1e-16 differences. atol for outputs that cancel to ~0.
    tol = dict(rtol=2 * U32, atol=1e-12) if dtype == np.float32 else dict(rtol=1e-13, atol=1e-14)
    for got, want in zip((out, mean, rstd), ref):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, **tol)


@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm_backward_matches_finite_differences(shape):
    N, C = shape
    x, w, b = layernorm_data(shape)
    R = rng_for(41, *shape).standard_normal((N, C))
    out, mean, rstd = np.empty((N, C)), np.empty(N), np.empty(N)

    def terms():
        return layernorm_forward(x, w, b, out, mean, rstd) * R

    terms()
    dx, dw, db = np.full((N, C), np.nan), np.full(C, np.nan), np.full(C, np.nan)
    assert layernorm_backward(R, x, w, mean, rstd, dx, dw, db) is dx
    np.testing.assert_allclose(dx, fd_grad(terms, x), **FD_TOL)
    np.testing.assert_allclose(dw, fd_grad(terms, w), **FD_TOL)
    np.testing.assert_allclose(db, fd_grad(terms, b), **FD_TOL)


def test_layernorm_backward_flags_add_to_prior_contents():
    x, w, b = layernorm_data((6, 12))
    out, mean, rstd = run_layernorm(x, w, b)
    r = rng_for(42)
    dout, dx0 = r.standard_normal((6, 12)), r.standard_normal((6, 12))
    dw0, db0 = r.standard_normal(12), r.standard_normal(12)
    dx, dw, db = np.empty((6, 12)), np.empty(12), np.empty(12)
    layernorm_backward(dout, x, w, mean, rstd, dx, dw, db)
    for accumulate in (False, True):
        for add_dx in (False, True):
            dx1, dw1, db1 = dx0.copy(), dw0.copy(), db0.copy()
            layernorm_backward(dout, x, w, mean, rstd, dx1, dw1, db1, accumulate=accumulate, add_dx=add_dx)
            # float64 everywhere: prior + (the float64 value) is one rounding either way
            np.testing.assert_array_equal(dx1, dx0 + dx if add_dx else dx)
            np.testing.assert_array_equal(dw1, dw0 + dw if accumulate else dw)
            np.testing.assert_array_equal(db1, db0 + db if accumulate else db)
    same = dout.copy()  # dx may be dout
    layernorm_backward(same, x, w, mean, rstd, same, dw1, db1)
    np.testing.assert_array_equal(same, dx)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset, scale", [(1e4, 1.0), (0.0, 1e15), (0.0, 1e-12)])
def test_layernorm_large_and_small_magnitudes_stay_finite_and_accurate(dtype, offset, scale):
    # |mean| >> std (offset 1e4) breaks a one-sweep E[x^2] - E[x]^2 variance in
    # float32; 1e15 squares to 1e30 (fine in the float64 accumulator); 1e-12
    # rows are below eps's scale, so xhat is small rather than amplified noise.
    x, w, b = layernorm_data((4, 24), dtype, offset, scale)
    out, mean, rstd = run_layernorm(x, w, b)
    ref = layernorm_ref(x, w, b)[0]
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(rstd))
    np.testing.assert_allclose(out, ref, rtol=4 * U32 if dtype == np.float32 else 1e-11, atol=1e-6)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    layernorm_backward(np.ones_like(x), x, w, mean, rstd, dx, dw, db)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))


# ---- attention ---------------------------------------------------------------------
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


# ---- residual ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_forward_and_in_place(dtype):
    r = rng_for(60)
    a, b = r.standard_normal((2, 3, 5)).astype(dtype), r.standard_normal((2, 3, 5)).astype(dtype)
    out = np.empty_like(a)
    assert residual_forward(a, b, out) is out
    np.testing.assert_array_equal(out, a + b)
    a2 = a.copy()
    residual_forward(a2, b, a2)  # the stream updated in place
    np.testing.assert_array_equal(a2, a + b)


def test_residual_backward_finite_differences_flags_and_none():
    r = rng_for(61)
    a, b, R = r.standard_normal((1, 1, 3)), r.standard_normal((1, 1, 3)), r.standard_normal((1, 1, 3))
    out = np.empty((1, 1, 3))

    def terms():
        return residual_forward(a, b, out) * R

    da, db = np.full((1, 1, 3), np.nan), np.full((1, 1, 3), np.nan)
    residual_backward(R, da, db)
    np.testing.assert_allclose(da, fd_grad(terms, a), **FD_TOL)
    np.testing.assert_allclose(db, fd_grad(terms, b), **FD_TOL)
    prior = r.standard_normal((1, 1, 3))
    da = prior.copy()
    residual_backward(R, da, None, accumulate=True)
    np.testing.assert_array_equal(da, prior + R)
    residual_backward(R, None, da)
    np.testing.assert_array_equal(da, R)


def test_gpt_ops_are_in_the_cpu_kernel_table():
    import importlib

    for op in ("embedding", "layernorm", "attention", "residual"):
        module = importlib.import_module(f"hpctrain.kernels.{op}")
        for half in ("forward", "backward"):
            name = f"{op}_{half}"
            assert getattr(CPU_OPS, name) is getattr(module, name)  # the twin itself, not something callable

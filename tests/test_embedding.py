"""Token + position embedding (hpctrain/kernels/embedding.py): the CPU twin against fancy indexing
and finite differences, and the CUDA kernels against the twin bit for bit.

Bitwise, and why: forward is one add per element in the arrays' dtype, as the twin; backward's
dwpe sums the batch in b order in float64, as the twin; dwte adds each row into dwte one at a time
in (b, t) order, as the twin's serial loop - the device only sorts the positions, it never
reorders a sum. GPT-2 small's shapes on a GPU only.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.device import CudaDevice
from hpctrain.kernels import embedding
from hpctrain.kernels.embedding import embedding_backward, embedding_forward
from kernel_checks import FD_TOL, U32, down, fd_grad, gpu, needs_cuda, rng_for, rng_gpt_cuda


DTYPES = [np.float32, np.float64]


# ---- reference (float64) -----------------------------------------------------------------
def embedding_ref(tokens, wte, wpe):
    return wte.astype(np.float64)[tokens] + wpe.astype(np.float64)[:tokens.shape[1]]


# ---- CPU twin (numba) --------------------------------------------------------------------
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


# ---- CUDA kernels against the twin -------------------------------------------------------
@pytest.fixture(scope="module", params=["float64", "float32"])
def dev(request):
    """A CUDA device of each float dtype (the simulator unless NUMBA_ENABLE_CUDASIM=0)."""
    return CudaDevice(request.param)


# (B, T, C, V, Tmax): T < Tmax (dwpe's unused rows); T = 1; C > 32 and not a
# multiple of it; C > TOKEN_THREADS (two channel blocks per id); 560 positions,
# more than the simulator's 2 x 256 threads, so the grid-stride loops iterate.
# Small vocabularies are skewed (one id takes 95% of the positions, a byte-level
# space taken to the extreme): buckets of one to hundreds of positions.
EMBED_SHAPES = [(2, 5, 7, 11, 8), (3, 1, 33, 5, 4), (2, 3, 130, 4, 3), (4, 9, 6, 3, 9), (8, 70, 3, 3, 70),
                pytest.param((8, 1024, 768, 50257, 1024), marks=gpu), pytest.param((32, 128, 768, 256, 128), marks=gpu)]


def embed_case(dtype, shape, skew=False):
    B, T, C, V, Tmax = shape
    r = rng_gpt_cuda(1, *shape)
    tokens = r.integers(0, V, size=(B, T)).astype(np.int64)
    if skew:  # one very common token (as a space in byte-level text)
        tokens[r.random((B, T)) < 0.95] = 1
    wte, wpe = (r.standard_normal(s).astype(dtype) for s in ((V, C), (Tmax, C)))
    dout = r.standard_normal((B, T, C)).astype(dtype)
    dwte0, dwpe0 = (r.standard_normal(s).astype(dtype) for s in ((V, C), (Tmax, C)))
    return tokens, wte, wpe, dout, dwte0, dwpe0


@needs_cuda
@pytest.mark.parametrize("shape", EMBED_SHAPES)
def test_embedding_forward_equals_twin_bitwise(dev, shape):
    tokens, wte, wpe, *_ = embed_case(dev.dtype, shape)
    B, T, C, _, _ = shape
    out = embedding.embedding_forward(tokens, wte, wpe, np.empty((B, T, C), dev.dtype))
    OUT = up(dev, np.full((B, T, C), np.nan, dev.dtype))
    embedding.embedding_forward_cuda(up(dev, tokens), up(dev, wte), up(dev, wpe), OUT, stream=dev.stream)
    np.testing.assert_array_equal(down(dev, OUT), out)


def run_embedding_backward(dev, tokens, dout, dwte0, dwpe0, accumulate):
    DWTE, DWPE = up(dev, dwte0), up(dev, dwpe0)
    embedding.embedding_backward_cuda(up(dev, dout), up(dev, tokens), DWTE, DWPE, accumulate,
                                      stream=dev.stream, scratch=dev.scratch)
    return down(dev, DWTE), down(dev, DWPE)


@needs_cuda
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape", EMBED_SHAPES)
def test_embedding_backward_equals_twin_bitwise(dev, shape, accumulate):
    tokens, _, _, dout, dwte0, dwpe0 = embed_case(dev.dtype, shape, skew=shape[3] < 1000)
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    embedding.embedding_backward(dout, tokens, dwte, dwpe, accumulate)
    got = run_embedding_backward(dev, tokens, dout, dwte0, dwpe0, accumulate)
    np.testing.assert_array_equal(got[0], dwte)  # repeated ids: rows added in (b, t) order, as the twin
    np.testing.assert_array_equal(got[1], dwpe)  # float64 batch sums in b order, as the twin


@needs_cuda
def test_embedding_backward_is_bitwise_identical_across_runs(dev):
    # the atomics place positions in a different order each run; the sort undoes it
    tokens, _, _, dout, dwte0, dwpe0 = embed_case(dev.dtype, EMBED_SHAPES[4], skew=True)
    runs = [run_embedding_backward(dev, tokens, dout, dwte0, dwpe0, False) for _ in range(2)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*runs))


@needs_cuda
def test_embedding_bad_ids_give_nan_rows_and_no_out_of_bounds_access(dev):
    # The simulator's arrays are NumPy arrays: an id >= V indexing wte (or the
    # bucket counts) would raise IndexError, and -1 would silently read the last
    # row - so NaN rows here mean the kernels checked the id and read nothing.
    shape = (2, 4, 5, 6, 4)
    tokens, wte, wpe, dout, dwte0, dwpe0 = embed_case(dev.dtype, shape)
    bad = [(0, 1), (1, 3)]
    tokens[0, 1], tokens[1, 3] = 6, -1
    OUT = up(dev, np.zeros((2, 4, 5), dev.dtype))
    embedding.embedding_forward_cuda(up(dev, tokens), up(dev, wte), up(dev, wpe), OUT, stream=dev.stream)
    out = down(dev, OUT)
    good = np.ones((2, 4), bool)
    for b, t in bad:
        good[b, t] = False
    assert np.isnan(out[~good]).all() and np.isfinite(out[good]).all()
    fixed = np.where(good, tokens, 0)
    ref = embedding.embedding_forward(fixed, wte, wpe, np.empty_like(out))
    np.testing.assert_array_equal(out[good], ref[good])
    # backward drops the bad rows from dwte (+ 0.0 leaves dwte[0] bitwise as it was); dwpe takes them all
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    embedding.embedding_backward(dout * good[..., None], fixed, dwte, dwpe0.copy())
    embedding.embedding_backward(dout, fixed, dwte0.copy(), dwpe)
    got = run_embedding_backward(dev, tokens, dout, dwte0, dwpe0, False)
    np.testing.assert_array_equal(got[0], dwte)
    np.testing.assert_array_equal(got[1], dwpe)


@needs_cuda
def test_embedding_shape_errors_match_twin(dev):
    wte, wpe, out = dev.zeros((5, 3)), dev.zeros((4, 3)), dev.zeros((1, 6, 3))
    with pytest.raises(ValueError, match="exceed the context of 4"):
        embedding.embedding_forward_cuda(up(dev, np.zeros((1, 6), np.int64)), wte, wpe, out, stream=dev.stream)
    with pytest.raises(ValueError, match="tokens must be integers"):
        embedding.embedding_backward_cuda(out, up(dev, np.zeros((1, 3), np.float64)), wte, wpe,
                                          stream=dev.stream, scratch=dev.scratch)

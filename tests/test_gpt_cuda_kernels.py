"""The GPT ops' CUDA kernels (embedding, layernorm, residual) against their CPU
twins, which test_gpt_ops.py checks against NumPy and finite differences.

Without a GPU these run on numba's CUDA simulator (conftest sets
NUMBA_ENABLE_CUDASIM=1), where every thread is a Python thread: shapes stay
tiny but ragged (rows not a multiple of a block's 8 rows or of the 128-row
gradient chunks, C not a multiple of 32, T = 1) and make grid-stride loops
iterate. The same checks at GPT-2 small sizes are marked ``gpu``.

What is bitwise and why:
- embedding forward, residual: one add (or copy) per element in the arrays'
  dtype, as the twin;
- embedding backward: dwpe sums the batch in b order in float64, as the twin;
  dwte adds each row into dwte one at a time in (b, t) order, as the twin's
  serial loop - the device only sorts the positions, it never reorders a sum.
LayerNorm sums a row (and dweight, dbias their rows) in another fixed order,
and the GPU fuses multiply-adds, so it is compared within bounds stated at
each test; it is still bitwise identical from run to run.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.device import CudaDevice, cuda_status
from hpctrain.kernels import embedding, layernorm, layernorm_cuda, residual
from conftest import up

pytestmark = pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")

U32, U64 = 2.0 ** -24, 2.0 ** -53
gpu = pytest.mark.gpu


def rng_for(*key):
    return np.random.default_rng([4041, *key])


@pytest.fixture(scope="module", params=["float64", "float32"])
def dev(request):
    return CudaDevice(request.param)


def down(dev, a):
    return dev.to_host(a).copy()


# ---- embedding ---------------------------------------------------------------------
# (B, T, C, V, Tmax): T < Tmax (dwpe's unused rows); T = 1; C > 32 and not a
# multiple of it; C > TOKEN_THREADS (two channel blocks per id); 560 positions,
# more than the simulator's 2 x 256 threads, so the grid-stride loops iterate.
# Small vocabularies are skewed (one id takes 95% of the positions, a byte-level
# space taken to the extreme): buckets of one to hundreds of positions.
EMBED_SHAPES = [(2, 5, 7, 11, 8), (3, 1, 33, 5, 4), (2, 3, 130, 4, 3), (4, 9, 6, 3, 9), (8, 70, 3, 3, 70),
                pytest.param((8, 1024, 768, 50257, 1024), marks=gpu), pytest.param((32, 128, 768, 256, 128), marks=gpu)]


def embed_case(dtype, shape, skew=False):
    B, T, C, V, Tmax = shape
    r = rng_for(1, *shape)
    tokens = r.integers(0, V, size=(B, T)).astype(np.int64)
    if skew:  # one very common token (as a space in byte-level text)
        tokens[r.random((B, T)) < 0.95] = 1
    wte, wpe = (r.standard_normal(s).astype(dtype) for s in ((V, C), (Tmax, C)))
    dout = r.standard_normal((B, T, C)).astype(dtype)
    dwte0, dwpe0 = (r.standard_normal(s).astype(dtype) for s in ((V, C), (Tmax, C)))
    return tokens, wte, wpe, dout, dwte0, dwpe0


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


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape", EMBED_SHAPES)
def test_embedding_backward_equals_twin_bitwise(dev, shape, accumulate):
    tokens, _, _, dout, dwte0, dwpe0 = embed_case(dev.dtype, shape, skew=shape[3] < 1000)
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    embedding.embedding_backward(dout, tokens, dwte, dwpe, accumulate)
    got = run_embedding_backward(dev, tokens, dout, dwte0, dwpe0, accumulate)
    np.testing.assert_array_equal(got[0], dwte)  # repeated ids: rows added in (b, t) order, as the twin
    np.testing.assert_array_equal(got[1], dwpe)  # float64 batch sums in b order, as the twin


def test_embedding_backward_is_bitwise_identical_across_runs(dev):
    # the atomics place positions in a different order each run; the sort undoes it
    tokens, _, _, dout, dwte0, dwpe0 = embed_case(dev.dtype, EMBED_SHAPES[4], skew=True)
    runs = [run_embedding_backward(dev, tokens, dout, dwte0, dwpe0, False) for _ in range(2)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*runs))


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


def test_embedding_shape_errors_match_twin(dev):
    wte, wpe, out = dev.zeros((5, 3)), dev.zeros((4, 3)), dev.zeros((1, 6, 3))
    with pytest.raises(ValueError, match="exceed the context of 4"):
        embedding.embedding_forward_cuda(up(dev, np.zeros((1, 6), np.int64)), wte, wpe, out, stream=dev.stream)
    with pytest.raises(ValueError, match="tokens must be integers"):
        embedding.embedding_backward_cuda(out, up(dev, np.zeros((1, 3), np.float64)), wte, wpe,
                                          stream=dev.stream, scratch=dev.scratch)


# ---- layernorm ---------------------------------------------------------------------
# (N, C): one row; 17 rows = two blocks of 8 and one row (the simulator's 2 blocks
# loop, the last group of 8 ragged), C > 32 so lanes loop; C = 70 spans three
# gradient column blocks.
LN_SHAPES = [(1, 5), (17, 33), (12, 70), pytest.param((8192, 768), marks=gpu)]


@pytest.fixture
def small_chunks(monkeypatch):
    """Under the simulator, dweight/dbias partials over chunks of at most 10 rows
    (not 128): the launcher makes ceil(N / 10) chunks and the kernel splits the N
    rows evenly over them, so 17 rows are two chunks, of 9 rows (row lane 0 sums
    two) and of 8 (clamped to N), and 12 rows two of 6. Every chunk is another row
    of 256-thread blocks: two, not the three of 8-row chunks, at a fraction of the
    simulated threads. The kernel reads the chunk size from its grid."""
    from hpctrain.kernels.cuda_support import simulated

    if simulated():
        monkeypatch.setattr(layernorm_cuda, "GRAD_ROWS", 10)


def ln_case(dtype, shape):
    N, C = shape
    r = rng_for(2, *shape)
    x = (3 * r.standard_normal((N, C)) + 10).astype(dtype)  # |mean| >> std: the centred variance matters
    weight, bias = (r.standard_normal(C).astype(dtype) for _ in range(2))
    dout, dx0 = (r.standard_normal((N, C)).astype(dtype) for _ in range(2))
    dw0, db0 = (r.standard_normal(C).astype(dtype) for _ in range(2))
    return x, weight, bias, dout, dx0, dw0, db0


def assert_close(dev, got, ref, f64_rtol, abs_scale):
    """float64: the kernel and twin sum in different orders (and the GPU fuses
    multiply-adds): ``f64_rtol`` relative to ``abs_scale`` (the magnitude of the
    terms, so cancellation is covered). float32: both compute the same value in
    float64 and round once on store, so they are equal or one ulp apart."""
    if dev.dtype == np.float64:
        assert np.all(np.abs(got - ref) <= f64_rtol * abs_scale), np.max(np.abs(got - ref) / abs_scale)
    else:
        ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(got.astype(np.float64) - ref) <= ulp + 1e-13 * abs_scale), \
            np.max(np.abs(got.astype(np.float64) - ref) / ulp)


@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm_forward_matches_twin(dev, shape):
    x, weight, bias, *_ = ln_case(dev.dtype, shape)
    N, C = shape
    out, mean, rstd = np.empty((N, C), dev.dtype), np.empty(N, dev.dtype), np.empty(N, dev.dtype)
    layernorm.layernorm_forward(x, weight, bias, out, mean, rstd)
    OUT, MEAN, RSTD = (up(dev, np.full(a.shape, np.nan, dev.dtype)) for a in (out, mean, rstd))
    W, B_ = up(dev, weight), up(dev, bias)
    layernorm_cuda.layernorm_forward_cuda(up(dev, x), W, B_, OUT, MEAN, RSTD, stream=dev.stream)
    got = down(dev, OUT), down(dev, MEAN), down(dev, RSTD)
    # C-term sums in another order: ~C u of sum|x| (C <= 768 -> < 1e-13 relative)
    assert_close(dev, got[1], mean, 1e-13, np.abs(x).mean(axis=1))
    assert_close(dev, got[2], rstd, 1e-13, rstd)
    assert_close(dev, got[0], out, 1e-12, np.abs(x - mean[:, None]) * rstd[:, None] * np.abs(weight)
                 + np.abs(bias) + 1)
    layernorm_cuda.layernorm_forward_cuda(up(dev, x), W, B_, OUT, MEAN, RSTD, stream=dev.stream)
    assert down(dev, OUT).tobytes() == got[0].tobytes()  # a fixed order: the same bits every run


@pytest.mark.parametrize("shape", [(17, 33), (40, 130)])
def test_residual_layernorm_forward_is_the_add_then_layernorm_bit_for_bit(dev, shape):
    """The fused op (a block's residual add into the next LayerNorm) against the device's own two
    kernels: the same sum and the same normalised rows, bit for bit; 130 channels reach the
    lanes' four-channel steps, 17 rows a ragged row group; the sum may be written over an input."""
    x, weight, bias, dout, *_ = ln_case(dev.dtype, shape)
    W, B_ = up(dev, weight), up(dev, bias)
    N, C = shape
    want = []
    S, OUT, MEAN, RSTD = dev.empty((N, C)), dev.empty((N, C)), dev.empty(N), dev.empty(N)
    dev.ops.residual_forward(up(dev, x), up(dev, dout), S)
    dev.ops.layernorm_forward(S, W, B_, OUT, MEAN, RSTD)
    want = [down(dev, a).tobytes() for a in (S, OUT, MEAN, RSTD)]
    for inplace in (False, True):
        A = up(dev, x)
        S, OUT, MEAN, RSTD = ((A if inplace else up(dev, np.full((N, C), np.nan, dev.dtype))),
                              *(up(dev, np.full(s, np.nan, dev.dtype)) for s in ((N, C), (N,), (N,))))
        dev.ops.residual_layernorm_forward(A, up(dev, dout), S, W, B_, OUT, MEAN, RSTD)
        assert [down(dev, a).tobytes() for a in (S, OUT, MEAN, RSTD)] == want, inplace
    s, out, mean, rstd = np.empty((N, C), dev.dtype), np.empty((N, C), dev.dtype), np.empty(N, dev.dtype), \
        np.empty(N, dev.dtype)
    layernorm.residual_layernorm_forward(x, dout, s, weight, bias, out, mean, rstd)   # the twin
    assert s.tobytes() == want[0]
    with pytest.raises(ValueError, match="residual_layernorm_forward: b is"):
        dev.ops.residual_layernorm_forward(up(dev, x), up(dev, dout[:1]), S, W, B_, OUT, MEAN, RSTD)


# every (accumulate, add_dx) pair once on the ragged 17 x 33; the other shapes once each
LN_BACKWARD_CASES = [((17, 33), False, False), ((17, 33), True, True), ((17, 33), False, True),
                     ((17, 33), True, False), ((1, 5), False, False), ((12, 70), True, True),
                     pytest.param((8192, 768), True, True, marks=gpu)]


@pytest.mark.parametrize("shape, accumulate, add_dx", LN_BACKWARD_CASES)
def test_layernorm_backward_matches_twin(dev, small_chunks, shape, accumulate, add_dx):
    x, weight, bias, dout, dx0, dw0, db0 = ln_case(dev.dtype, shape)
    N, C = shape
    mean, rstd = np.empty(N, dev.dtype), np.empty(N, dev.dtype)
    layernorm.layernorm_forward(x, weight, bias, np.empty_like(x), mean, rstd)
    dx, dw, db = dx0.copy(), dw0.copy(), db0.copy()
    layernorm.layernorm_backward(dout, x, weight, mean, rstd, dx, dw, db, accumulate, add_dx)
    DX, DW, DB = up(dev, dx0), up(dev, dw0), up(dev, db0)
    args = up(dev, x), up(dev, weight), up(dev, mean), up(dev, rstd)
    layernorm_cuda.layernorm_backward_cuda(up(dev, dout), *args, DX, DW, DB, accumulate, add_dx,
                                      stream=dev.stream, scratch=dev.scratch)
    xhat = np.abs((x - mean[:, None]) * rstd[:, None])
    g = np.abs(dout * weight)
    # dx's two C-term row means in another order, then a cancelling difference: relative to its terms
    assert_close(dev, down(dev, DX), dx, 1e-12,
                 (g + (g * xhat).mean(axis=1, keepdims=True) * (1 + xhat)) * rstd[:, None] + add_dx * np.abs(dx0))
    # N-term float64 column sums in another order: 2 (N + 2) u of sum|terms|
    for got, ref, terms, old in ((DW, dw, np.abs(dout) * xhat, dw0), (DB, db, np.abs(dout), db0)):
        assert_close(dev, down(dev, got), ref, 2 * (N + 2) * U64, terms.sum(axis=0) + accumulate * np.abs(old))


def test_layernorm_four_element_steps_match_twin(dev):
    """40 rows x 130 channels, one 128-row gradient chunk: each lane's four-channel steps
    (forward and dx), the partial sums' four-row steps, and both loops' remainders; the
    shapes above are too narrow or their chunks too short to reach them."""
    test_layernorm_forward_matches_twin(dev, (40, 130))
    test_layernorm_backward_matches_twin(dev, None, (40, 130), True, True)


# 130 channels: the lanes' four-channel steps (and two lanes' remainders); 17 rows as
# above (row loop, ragged group, two gradient chunks): 2 x 5 partial-sum blocks where
# 40 rows in chunks of 8 launched 5 x 5
@pytest.mark.parametrize("shape", [(17, 33), (17, 130)])
def test_layernorm_backward_dx_may_be_dout_and_is_deterministic(dev, small_chunks, shape):
    x, weight, bias, dout, _, _, _ = ln_case(dev.dtype, shape)
    N, C = x.shape
    mean, rstd = np.empty(N, dev.dtype), np.empty(N, dev.dtype)
    layernorm.layernorm_forward(x, weight, bias, np.empty_like(x), mean, rstd)
    args = up(dev, x), up(dev, weight), up(dev, mean), up(dev, rstd)
    results = []
    for alias in (False, True):
        D, DW, DB = up(dev, dout), dev.empty(C), dev.empty(C)
        DX = D if alias else dev.empty((N, C))
        layernorm_cuda.layernorm_backward_cuda(D, *args, DX, DW, DB, stream=dev.stream, scratch=dev.scratch)
        results.append(b"".join(down(dev, a).tobytes() for a in (DX, DW, DB)))
    # dweight and dbias read dout before dx overwrites it: aliasing changes no bit,
    # and the second run has the first one's bits (fixed summation orders)
    assert results[0] == results[1]


# ---- residual ----------------------------------------------------------------------
# 1600 elements: past three grid strides of the simulator's 2 x 256 threads, so the
# kernels' four-element steps run, then their remainder
RES_SHAPES = [(1, 1, 3), (2, 7, 45), (4, 8, 50), pytest.param((8, 1024, 768), marks=gpu)]


@pytest.mark.parametrize("shape", RES_SHAPES)
def test_residual_forward_backward_equal_twin_bitwise(dev, shape):
    r = rng_for(3, *shape)
    a, b, dout, da0, db0 = (r.standard_normal(shape).astype(dev.dtype) for _ in range(5))
    ref = residual.residual_forward(a, b, np.empty_like(a))
    for alias in ("a", "b", None):  # out may be either input
        A, B_ = up(dev, a), up(dev, b)
        OUT = {"a": A, "b": B_, None: dev.empty(shape)}[alias]
        residual.residual_forward_cuda(A, B_, OUT, stream=dev.stream)
        np.testing.assert_array_equal(down(dev, OUT), ref)
    for accumulate in (False, True):
        for skip in (None, "da", "db"):  # a None gradient is skipped
            da, db = da0.copy(), db0.copy()
            residual.residual_backward(dout, None if skip == "da" else da, None if skip == "db" else db, accumulate)
            DA, DB = up(dev, da0), up(dev, db0)
            residual.residual_backward_cuda(up(dev, dout), None if skip == "da" else DA,
                                            None if skip == "db" else DB, accumulate, stream=dev.stream)
            np.testing.assert_array_equal(down(dev, DA), da)
            np.testing.assert_array_equal(down(dev, DB), db)
    residual.residual_backward_cuda(up(dev, dout), None, None, stream=dev.stream)  # nothing to do


def test_residual_refuses_mismatched_shapes(dev):
    with pytest.raises(ValueError, match="residual stream's shape"):
        residual.residual_forward_cuda(dev.zeros((2, 3)), dev.zeros((3, 2)), dev.zeros((2, 3)), stream=dev.stream)

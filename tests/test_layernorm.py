"""Layer normalisation (hpctrain/kernels/layernorm.py): the CPU twin against a float64 reference
and finite differences, and the CUDA kernels against the twin.

The kernels sum a row (and dweight, dbias their rows) in another fixed order than the twin, and
the GPU fuses multiply-adds, so they are compared within bounds stated at each test; they are
still bitwise identical from run to run. CUDA shapes: one row; 17 rows = two blocks of 8 and one
row (the simulator's 2 blocks loop, the last group of 8 ragged), C > 32 so lanes loop; C = 70
spans three gradient column blocks; GPT-2 small's on a GPU only.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.device import CudaDevice
from hpctrain.kernels import layernorm, layernorm_cuda
from hpctrain.kernels.layernorm import layernorm_backward, layernorm_forward
from kernel_checks import FD_TOL, U32, U64, down, fd_grad, gpu, needs_cuda, rng_for, rng_gpt_cuda


DTYPES = [np.float32, np.float64]


# ---- reference (float64) -----------------------------------------------------------------
def layernorm_ref(x, w, b, eps=1e-5):
    x = x.astype(np.float64)
    mean, var = x.mean(axis=1), x.var(axis=1)  # biased variance, as PyTorch
    rstd = 1.0 / np.sqrt(var + eps)
    return (x - mean[:, None]) * rstd[:, None] * w + b, mean, rstd


# ---- CPU twin (numba) --------------------------------------------------------------------
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


# ---- CUDA kernels against the twin -------------------------------------------------------
@pytest.fixture(scope="module", params=["float64", "float32"])
def dev(request):
    """A CUDA device of each float dtype (the simulator unless NUMBA_ENABLE_CUDASIM=0)."""
    return CudaDevice(request.param)


# (N, C): one row; 17 rows = two blocks of 8 and one row (the simulator's 2 blocks
# loop, the last group of 8 ragged), C > 32 so lanes loop; C = 70 spans three
# gradient column blocks.
LN_SHAPES_CUDA = [(1, 5), (17, 33), (12, 70), pytest.param((8192, 768), marks=gpu)]


@pytest.fixture
def small_chunks(monkeypatch):
    """Under the simulator, dweight/dbias partials over chunks of at most 10 rows
    (not 128): the launcher makes ceil(N / 10) chunks and the kernel splits the N
    rows evenly over them, so 17 rows are two chunks, of 9 rows (row lane 0 sums
    two) and of 8 (clamped to N), and 12 rows two of 6. Every chunk is another row
    of 256-thread blocks: two, not the three of 8-row chunks, at a fraction of the
    simulated threads. The kernel reads the chunk size from its grid."""
    from hpctrain.kernels.support.cuda_support import simulated

    if simulated():
        monkeypatch.setattr(layernorm_cuda, "GRAD_ROWS", 10)


def ln_case(dtype, shape):
    N, C = shape
    r = rng_gpt_cuda(2, *shape)
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


@needs_cuda
@pytest.mark.parametrize("shape", LN_SHAPES_CUDA)
def test_layernorm_forward_matches_twin(dev, shape):
    x, weight, bias, *_ = ln_case(dev.dtype, shape)
    N, C = shape
    out, mean, rstd = np.empty((N, C), dev.dtype), np.empty(N, dev.dtype), np.empty(N, dev.dtype)
    layernorm.layernorm_forward(x, weight, bias, out, mean, rstd)
    OUT, MEAN, RSTD = (up(dev, np.full(a.shape, np.nan, dev.dtype)) for a in (out, mean, rstd))
    W, B_ = up(dev, weight), up(dev, bias)
    layernorm.layernorm_forward_cuda(up(dev, x), W, B_, OUT, MEAN, RSTD, stream=dev.stream)
    got = down(dev, OUT), down(dev, MEAN), down(dev, RSTD)
    # C-term sums in another order: ~C u of sum|x| (C <= 768 -> < 1e-13 relative)
    assert_close(dev, got[1], mean, 1e-13, np.abs(x).mean(axis=1))
    assert_close(dev, got[2], rstd, 1e-13, rstd)
    assert_close(dev, got[0], out, 1e-12, np.abs(x - mean[:, None]) * rstd[:, None] * np.abs(weight)
                 + np.abs(bias) + 1)
    layernorm.layernorm_forward_cuda(up(dev, x), W, B_, OUT, MEAN, RSTD, stream=dev.stream)
    assert down(dev, OUT).tobytes() == got[0].tobytes()  # a fixed order: the same bits every run


@needs_cuda
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


@needs_cuda
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
    layernorm.layernorm_backward_cuda(up(dev, dout), *args, DX, DW, DB, accumulate, add_dx,
                                      stream=dev.stream, scratch=dev.scratch)
    xhat = np.abs((x - mean[:, None]) * rstd[:, None])
    g = np.abs(dout * weight)
    # dx's two C-term row means in another order, then a cancelling difference: relative to its terms
    assert_close(dev, down(dev, DX), dx, 1e-12,
                 (g + (g * xhat).mean(axis=1, keepdims=True) * (1 + xhat)) * rstd[:, None] + add_dx * np.abs(dx0))
    # N-term float64 column sums in another order: 2 (N + 2) u of sum|terms|
    for got, ref, terms, old in ((DW, dw, np.abs(dout) * xhat, dw0), (DB, db, np.abs(dout), db0)):
        assert_close(dev, down(dev, got), ref, 2 * (N + 2) * U64, terms.sum(axis=0) + accumulate * np.abs(old))


@needs_cuda
def test_layernorm_four_element_steps_match_twin(dev):
    """40 rows x 130 channels, one 128-row gradient chunk: each lane's four-channel steps
    (forward and dx), the partial sums' four-row steps, and both loops' remainders; the
    shapes above are too narrow or their chunks too short to reach them."""
    test_layernorm_forward_matches_twin(dev, (40, 130))
    test_layernorm_backward_matches_twin(dev, None, (40, 130), True, True)


# 130 channels: the lanes' four-channel steps (and two lanes' remainders); 17 rows as
# above (row loop, ragged group, two gradient chunks): 2 x 5 partial-sum blocks where
# 40 rows in chunks of 8 launched 5 x 5
@needs_cuda
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
        layernorm.layernorm_backward_cuda(D, *args, DX, DW, DB, stream=dev.stream, scratch=dev.scratch)
        results.append(b"".join(down(dev, a).tobytes() for a in (DX, DW, DB)))
    # dweight and dbias read dout before dx overwrites it: aliasing changes no bit,
    # and the second run has the first one's bits (fixed summation orders)
    assert results[0] == results[1]

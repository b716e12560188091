"""The Linear op (hpctrain/kernels/linear.py): the CPU twin against NumPy and finite differences,
the tiled CUDA GEMM within the dot-product error bound, and the CUDA launchers against the twin.

Forward passes are compared with references written here from the formulas; backward passes with
central finite differences in float64 of the scalar objective sum(out * R) for a random R. On the
simulator the GEMM shapes stay at 5-70 while still leaving tiles partly filled and spanning more
than one block; realistic sizes are marked ``gpu``. float64 CUDA runs are held to the twin within
two n-term sums' rounding (assert_sums_close), float32 GEMMs to the standard dot-product error
bound against a float64 product.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.kernels import linear
from hpctrain.kernels.linear import linear_backward, linear_forward
from kernel_checks import FD_TOL, SHAPES, U32, assert_sums_close, fd_grad, gpu, needs_cuda, rng_cuda, rng_for


# ---- CPU twin (NumPy/BLAS) ---------------------------------------------------------------
def linear_data(shape, dtype=np.float64):
    B, I, O = shape
    r = rng_for(1, *shape)
    x = r.standard_normal((B, I)).astype(dtype)
    w = r.standard_normal((I, O)).astype(dtype)
    b = r.standard_normal(O).astype(dtype)
    return x, w, b


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_forward_matches_numpy(shape):
    x, w, _ = linear_data(shape)
    z = np.full((shape[0], shape[2]), np.nan)
    assert linear_forward(x, w, z) is z
    np.testing.assert_allclose(z, np.einsum("bi,io->bo", x, w), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_backward_matches_finite_differences(shape):
    B, I, O = shape
    x, w, _ = linear_data(shape)
    R = rng_for(2, *shape).standard_normal((B, O))
    z = np.empty((B, O))

    def terms():
        return linear_forward(x, w, z) * R

    dx, dw = np.full((B, I), np.nan), np.full((I, O), np.nan)
    assert linear_backward(R, x, w, dx, dw) is dx
    np.testing.assert_allclose(dx, fd_grad(terms, x), **FD_TOL)
    np.testing.assert_allclose(dw, fd_grad(terms, w), **FD_TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_backward_into_flat_buffer_views(shape):
    """dw is a view of one flat gradient buffer, as FlatParams hands it out."""
    B, I, O = shape
    x, w, _ = linear_data(shape)
    dz = rng_for(3, *shape).standard_normal((B, O))
    flat = np.full(1 + I * O + 1, 7.0)  # one guard element on each side
    dw = flat[1:1 + I * O].reshape(I, O)
    linear_backward(dz, x, w, None, dw)
    np.testing.assert_allclose(dw, x.T @ dz, rtol=1e-13, atol=1e-13)
    assert flat[0] == 7.0 and flat[-1] == 7.0  # nothing written outside the views


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_backward_accumulate_adds_to_existing_grads(shape):
    B, I, O = shape
    x, w, _ = linear_data(shape)
    r = rng_for(4, *shape)
    dz = r.standard_normal((B, O))
    dw0 = r.standard_normal((I, O))
    dw, dx = dw0.copy(), np.full((B, I), np.nan)
    linear_backward(dz, x, w, dx, dw, accumulate=True)
    np.testing.assert_allclose(dw, dw0 + x.T @ dz, rtol=1e-13, atol=1e-13)
    # dx is an activation gradient, never accumulated
    np.testing.assert_allclose(dx, dz @ w.T, rtol=1e-13, atol=1e-13)

    # accumulate=False overwrites whatever was there
    linear_backward(dz, x, w, dx, dw, accumulate=False)
    np.testing.assert_allclose(dw, x.T @ dz, rtol=1e-13, atol=1e-13)


def test_linear_backward_dx_none_returns_none_and_still_fills_weight_grads():
    x, w, _ = linear_data((3, 5, 7))
    dz = rng_for(5).standard_normal((3, 7))
    dw = np.zeros((5, 7))
    assert linear_backward(dz, x, w, None, dw) is None
    np.testing.assert_allclose(dw, x.T @ dz, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_float32_forward_within_rounding_bound(shape):
    # A length-I dot product in float32 (any summation order, FMA or not) is
    # within gamma_I * |x||w| of the exact value, gamma_n = n u / (1 - n u)
    # ~ n * 2^-24. A factor 2 covers the final rounding of the stored result;
    # a wrong formula misses by O(1).
    B, I, O = shape
    x, w, _ = linear_data(shape, np.float32)
    z = np.empty((B, O), dtype=np.float32)
    linear_forward(x, w, z)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    bound = 2 * (I + 1) * U32 * (np.abs(x64) @ np.abs(w64))
    assert z.dtype == np.float32
    assert np.all(np.abs(z - x64 @ w64) <= bound)


# ---- CUDA: the GEMM kernel ---------------------------------------------------------------
# (M, N, K): one partial tile; K spanning two BK slabs; two by two blocks of
# 64 x 64 with ragged edges; realistic sizes on the GPU only.
# The large tiling (128 x 128, BK 8) and the tiny one (16 x 16, one output a thread) run the
# same code with other constants; in the simulator large is checked on one block, K spanning
# three slabs, and tiny on one block and on three by two ragged blocks, K spanning two slabs.
GEMM_CASES = [((5, 7, 9), "small"), ((33, 20, 17), "small"), ((70, 66, 20), "small"),
              ((5, 7, 9), "large"), ((33, 20, 17), "large"), ((5, 7, 9), "tiny"), ((33, 20, 17), "tiny"),
              pytest.param((1000, 777, 513), "tiny", marks=gpu),
              pytest.param((1000, 777, 513), "small", marks=gpu), pytest.param((1000, 777, 513), "large", marks=gpu),
              pytest.param((2048, 2048, 2048), "large", marks=gpu)]


@needs_cuda
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("shape, tile", GEMM_CASES)
def test_gemm_float32_within_dot_product_bound(dev32, shape, tile, trans_a, trans_b):
    M, N, K = shape
    r = rng_cuda(1, *shape, trans_a, trans_b)
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


def test_gemm_takes_large_tiles_only_when_they_fill_the_gpu_and_tiny_ones_for_skinny_products():
    sms = 132  # an H200
    assert linear.choose_tile(16, 4096, sms) == "tiny"           # a 64-row tile would be 3/4 empty
    assert linear.choose_tile(4096, 8, sms) == "tiny"
    assert linear.choose_tile(17, 17, sms) == "small"
    assert linear.choose_tile(16 * 65535 + 1, 8, sms) == "large"  # tiny's rows of tiles would not fit the grid
    assert linear.choose_tile(256, 256, sms) == "small"          # 4 large tiles: most SMs idle
    assert linear.choose_tile(4096, 4096, sms) == "large"        # 1024 large tiles
    assert linear.choose_tile(128 * 22, 128 * 12, sms) == "large"  # exactly 2 blocks per SM
    assert linear.choose_tile(128 * 22, 128 * 11, sms) == "small"  # one block per SM short
    assert linear.choose_tile(128 * 22, 128 * 12, 2 * sms) == "small"  # a bigger GPU wants more


@needs_cuda
def test_gemm_refuses_mismatched_shapes(dev32):
    a, b, c = dev32.zeros((4, 5)), dev32.zeros((6, 3)), dev32.zeros((4, 3))
    with pytest.raises(ValueError, match="gemm shapes"):
        linear.gemm_cuda(a, b, c)


# ---- CUDA: the launchers against the twin ------------------------------------------------
LINEAR_SHAPES = [(9, 5, 7), (17, 33, 6), pytest.param((512, 1024, 768), marks=gpu)]


@needs_cuda
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_forward_backward_match_twin(dev64, shape):
    B, I, O = shape
    r = rng_cuda(2, *shape)
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

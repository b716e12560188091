"""The residual add (hpctrain/kernels/residual.py): the CPU twin in place and against finite
differences, and the CUDA kernels bit for bit the twin (one add, or copy, per element in the
arrays' dtype), with out aliasing either input and a None gradient skipped.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.device import CudaDevice
from hpctrain.kernels import residual
from hpctrain.kernels.residual import residual_backward, residual_forward
from kernel_checks import FD_TOL, down, fd_grad, gpu, needs_cuda, rng_for, rng_gpt_cuda


DTYPES = [np.float32, np.float64]


# ---- CPU twin (NumPy) --------------------------------------------------------------------
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


# ---- CUDA kernels against the twin -------------------------------------------------------
@pytest.fixture(scope="module", params=["float64", "float32"])
def dev(request):
    """A CUDA device of each float dtype (the simulator unless NUMBA_ENABLE_CUDASIM=0)."""
    return CudaDevice(request.param)


# 1600 elements: past three grid strides of the simulator's 2 x 256 threads, so the
# kernels' four-element steps run, then their remainder
RES_SHAPES = [(1, 1, 3), (2, 7, 45), (4, 8, 50), pytest.param((8, 1024, 768), marks=gpu)]


@needs_cuda
@pytest.mark.parametrize("shape", RES_SHAPES)
def test_residual_forward_backward_equal_twin_bitwise(dev, shape):
    r = rng_gpt_cuda(3, *shape)
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


@needs_cuda
def test_residual_refuses_mismatched_shapes(dev):
    with pytest.raises(ValueError, match="residual stream's shape"):
        residual.residual_forward_cuda(dev.zeros((2, 3)), dev.zeros((3, 2)), dev.zeros((2, 3)), stream=dev.stream)

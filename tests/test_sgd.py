"""SGD with momentum (hpctrain/kernels/sgd.py): the CPU twin against a float64 reference with
PyTorch's semantics and closed forms, and the CUDA kernel against the twin over two steps (the
momentum state carries over). The optimizer class around it is tests/test_optim.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.kernels import sgd
from hpctrain.kernels.sgd import sgd_step
from kernel_checks import LRS, OPT_SIZES, P, TIGHT, TOL, TOL64, needs_cuda, problem, rng_cuda


# ---- reference (PyTorch semantics, float64) ----------------------------------------------
def sgd_ref(p0, grads, lrs, momentum, weight_decay, nesterov):
    p = p0.astype(np.float64)
    buf = np.zeros_like(p)
    for g, lr in zip(grads, lrs):
        d = g.astype(np.float64) + weight_decay * p
        if momentum != 0:
            buf = momentum * buf + d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
    return p, buf


# ---- CPU twin (numba) --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_step_matches_reference(dtype, momentum, nesterov, weight_decay):
    p0, grads = problem(dtype)
    p, buf = p0.copy(), np.zeros(P, dtype=dtype)
    for g, lr in zip(grads, LRS):
        sgd_step(p, g, buf, lr, momentum, weight_decay, nesterov)
    ref_p, ref_buf = sgd_ref(p0, grads, LRS, momentum, weight_decay, nesterov)
    assert p.dtype == dtype and buf.dtype == dtype
    np.testing.assert_allclose(p, ref_p, **TOL[dtype])
    np.testing.assert_allclose(buf, ref_buf, **TOL[dtype])


def test_sgd_momentum_closed_form_two_steps():
    # constant g, mu=0.9: v1 = g, v2 = 1.9 g -> p2 = p0 - lr (1 + 1.9) g
    # Nesterov: d1 = g + 0.9 g = 1.9 g, d2 = g + 0.9 * 1.9 g = 2.71 g -> 4.61
    g = np.array([1.0, -2.0, 0.5])
    for nesterov, factor in ((False, 2.9), (True, 4.61)):
        p, buf = np.zeros(3), np.zeros(3)
        for _ in range(2):
            sgd_step(p, g, buf, 0.1, 0.9, 0.0, nesterov)
        np.testing.assert_allclose(p, -0.1 * factor * g, rtol=1e-14)
        np.testing.assert_allclose(buf, 1.9 * g, rtol=1e-14)


def test_sgd_weight_decay_is_l2_added_to_the_gradient():
    # zero gradient, no momentum: p <- p - lr*wd*p = p (1 - lr wd)
    p = np.array([1.0, -4.0])
    sgd_step(p, np.zeros(2), np.zeros(2), 0.5, 0.0, 0.1, False)
    np.testing.assert_allclose(p, [0.95, -3.8], rtol=1e-15)


def test_sgd_without_momentum_leaves_the_buffer_alone():
    p0, grads = problem(np.float64, key=1)
    p, buf = p0.copy(), np.full(P, 123.0)   # stale values must not leak into the step
    sgd_step(p, grads[0], buf, 0.1, 0.0, 0.01, True)
    np.testing.assert_array_equal(buf, 123.0)
    np.testing.assert_allclose(p, p0 - 0.1 * (grads[0] + 0.01 * p0), **TOL64)


# ---- CUDA kernel against the twin --------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("n", OPT_SIZES)
def test_sgd_step_matches_twin(dev64, n, nesterov):
    r = rng_cuda(6, n)
    p, g, v = r.standard_normal(n), r.standard_normal(n), r.standard_normal(n)
    P, G, V = up(dev64, p), up(dev64, g), up(dev64, v)
    for lr in (0.1, 0.05):  # two steps: the momentum state carries over
        sgd.sgd_step(p, g, v, lr, 0.9, 1e-2, nesterov)
        dev64.ops.sgd_update(P, G, V, up(dev64, sgd.hyperparameters(np.float64, lr, 0.9, 1e-2)), nesterov)
    np.testing.assert_allclose(dev64.to_host(P), p, **TIGHT)
    np.testing.assert_allclose(dev64.to_host(V), v, **TIGHT)

"""AdamW (hpctrain/kernels/adamw.py): the CPU twin against a float64 reference with PyTorch's
semantics (the frozen second moment and the summed-velocity mode too), and the CUDA kernel against
the twin over three steps. The optimizer class around it is tests/test_optim.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.kernels import adamw
from hpctrain.kernels.adamw import adamw_step
from kernel_checks import LRS, OPT_SIZES, P, STEPS, TIGHT, TOL, needs_cuda, problem, rng_cuda


# ---- reference (PyTorch semantics, float64) ----------------------------------------------
def adamw_ref(p0, grads, lrs, beta1, beta2, eps, weight_decay, freeze_step=0):
    """float64 AdamW; after step ``freeze_step`` (> 0) v and its bias correction stay as they were."""
    p = p0.astype(np.float64)
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.astype(np.float64)
        frozen = 0 < freeze_step < t
        p = p * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * g
        if not frozen:
            v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1 ** t)
        v_hat = v / (1 - beta2 ** (freeze_step if frozen else t))
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


# ---- CPU twin (numba) --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.9)])
def test_adamw_step_matches_reference(dtype, weight_decay, betas):
    beta1, beta2 = betas
    eps = 1e-8
    p0, grads = problem(dtype, key=2)
    p, m, v = p0.copy(), np.zeros(P, dtype=dtype), np.zeros(P, dtype=dtype)
    for t, (g, lr) in enumerate(zip(grads, LRS), start=1):
        adamw_step(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay)
    ref_p, ref_m, ref_v = adamw_ref(p0, grads, LRS, beta1, beta2, eps, weight_decay)
    assert p.dtype == m.dtype == v.dtype == dtype
    np.testing.assert_allclose(p, ref_p, **TOL[dtype])
    np.testing.assert_allclose(m, ref_m, **TOL[dtype])
    np.testing.assert_allclose(v, ref_v, **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("freeze_step", [1, 2])
def test_adamw_with_a_frozen_second_moment_matches_reference(dtype, freeze_step):
    p0, grads = problem(dtype, key=5)
    p, m, v = p0.copy(), np.zeros(P, dtype=dtype), np.zeros(P, dtype=dtype)
    for t, (g, lr) in enumerate(zip(grads, LRS), start=1):  # step t is global step t - 1
        adamw_step(p, g, m, v, t, lr, 0.9, 0.95, 1e-8, 0.01, freeze_step if t > freeze_step else 0)
        if t == freeze_step:
            v_frozen = v.copy()
    assert freeze_step < STEPS and np.array_equal(v, v_frozen)  # not one bit moved after the freeze
    ref_p, ref_m, ref_v = adamw_ref(p0, grads, LRS, 0.9, 0.95, 1e-8, 0.01, freeze_step)
    np.testing.assert_allclose(p, ref_p, **TOL[dtype])
    np.testing.assert_allclose(m, ref_m, **TOL[dtype])
    # the freeze changes the result (the test is not vacuous)
    assert not np.allclose(ref_p, adamw_ref(p0, grads, LRS, 0.9, 0.95, 1e-8, 0.01)[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("start", [1, 2, 4])
def test_adamw_taking_summed_velocities_is_adamw(dtype, start):
    """Momentum correction (dist.compress_momentum): from global step ``start`` on the kernel is handed
    the velocity u <- b1 u + (1 - b1) g (from u = 0 at ``start``) instead of g; what it does with it is
    plain AdamW with the second moment frozen at ``start``."""
    p0, grads = problem(dtype, key=9)
    beta1 = 0.9
    p, m, v = p0.copy(), np.zeros(P, dtype), np.zeros(P, dtype)
    u = np.zeros(P, np.float64)
    for t, (g, lr) in enumerate(zip(grads, LRS), start=1):  # step t is global step t - 1
        frozen = start if t > start else 0
        if t > start:
            u = beta1 * u + (1 - beta1) * g.astype(np.float64)
            adamw_step(p, u.astype(dtype), m, v, t, lr, beta1, 0.95, 1e-8, 0.01, frozen, True)
        else:
            adamw_step(p, g, m, v, t, lr, beta1, 0.95, 1e-8, 0.01, frozen)
    ref_p, ref_m, _ = adamw_ref(p0, grads, LRS, beta1, 0.95, 1e-8, 0.01, start)
    np.testing.assert_allclose(p, ref_p, **TOL[dtype])
    # m holds only what remains of the first moment from before: b1^(steps since) of it
    m_before = adamw_ref(p0, grads[:start], LRS[:start], beta1, 0.95, 1e-8, 0.01, start)[1]
    np.testing.assert_allclose(m, beta1 ** (STEPS - start) * m_before, **TOL[dtype])
    # handing the velocity to a plain step instead moves elsewhere (the test is not vacuous)
    q, mm, vv = p0.copy(), np.zeros(P, dtype), np.zeros(P, dtype)
    uu = np.zeros(P)
    for t, (g, lr) in enumerate(zip(grads, LRS), start=1):
        if t > start:
            uu = beta1 * uu + (1 - beta1) * g.astype(np.float64)
            g = uu.astype(dtype)
        adamw_step(q, g, mm, vv, t, lr, beta1, 0.95, 1e-8, 0.01, start if t > start else 0)
    assert not np.allclose(q, ref_p, rtol=1e-6, atol=0)


def test_adamw_after_the_freeze_is_linear_in_the_gradient():
    # what error-feedback compression needs: two steps of g/2 from equal states move p as one
    # step of g would, up to the momentum's decay between them (here beta1 = 0: exactly)
    p0, grads = problem(np.float64, key=6)
    v = np.abs(grads[0]) + 0.5
    moved = []
    for gs in ([grads[1]], [grads[1] / 2, grads[1] / 2]):
        p, m, vv = p0.copy(), np.zeros(P), v.copy()
        for g in gs:
            adamw_step(p, g, m, vv, 5, 0.01, 0.0, 0.9, 1e-8, 0.0, 2)
        moved.append(p - p0)
    np.testing.assert_allclose(moved[1], moved[0], rtol=1e-12, atol=1e-15)


def test_adamw_first_step_is_lr_times_sign_of_grad():
    # t=1: m_hat = g and v_hat = g^2 exactly, so the step is lr * g / (|g| + eps)
    g = np.array([3.0, -0.5, 1e-3])
    p, m, v = np.ones(3), np.zeros(3), np.zeros(3)
    adamw_step(p, g, m, v, 1, 0.01, 0.9, 0.999, 1e-8, 0.0)
    np.testing.assert_allclose(p, 1.0 - 0.01 * g / (np.abs(g) + 1e-8), rtol=1e-12)


def test_adamw_weight_decay_is_decoupled():
    # zero gradient: moments stay 0, the Adam term is 0/(0+eps)=0, only p *= 1 - lr wd remains
    p, m, v = np.array([2.0, -1.0]), np.zeros(2), np.zeros(2)
    adamw_step(p, np.zeros(2), m, v, 1, 0.1, 0.9, 0.999, 1e-8, 0.01)
    np.testing.assert_allclose(p, [2.0 * 0.999, -0.999], rtol=1e-15)


# ---- CUDA kernel against the twin --------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("n", OPT_SIZES)
@pytest.mark.parametrize("freeze,velocity", [(False, False), (True, False), (True, True)])
def test_adamw_step_matches_twin(dev64, n, freeze, velocity):
    r = rng_cuda(7, n)
    p, g = r.standard_normal(n), r.standard_normal(n)
    m, v = np.zeros(n), np.zeros(n)
    P, G, M, V = up(dev64, p), up(dev64, g), up(dev64, m), up(dev64, v)
    for step in (1, 2, 3):
        frozen_at = 2 if freeze and step == 3 else 0  # the second moment frozen after two updates
        vel = velocity and step == 3  # and g taken as a summed velocity (dist.compress_momentum)
        adamw.adamw_step(p, g, m, v, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, frozen_at, vel)
        hyper = adamw.hyperparameters(np.float64, step, 1e-3, 0.9, 0.999, 1e-8, 0.01, frozen_at)
        dev64.ops.adamw_update(P, G, M, V, up(dev64, hyper), vel)
    for got, ref in ((P, p), (M, m), (V, v)):
        np.testing.assert_allclose(dev64.to_host(got), ref, **TIGHT)

"""Optimizer kernels, optimizer classes and the LR schedule against NumPy/closed-form references."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

from hpctrain.training.config import OptimConfig
from hpctrain.device import CpuDevice
from hpctrain.kernels.adamw import adamw_step
from hpctrain.kernels.sgd import sgd_step
from hpctrain.nn import FlatParams
from hpctrain.optim import SGD, AdamW, LRSchedule, make_optimizer, peak_lr

P = 37        # odd parameter count
STEPS = 5
LRS = [0.1, 0.07, 0.05, 0.02, 0.01]   # a different lr each step, as a schedule gives

# float64: the kernel does the reference's arithmetic in the same order, so
# only a few roundings differ over 5 steps.
TOL64 = dict(rtol=1e-12, atol=1e-14)
# float32: the kernel computes in float64 but stores p and the state (v / m, v)
# as float32 after every step, each store a relative error <= 2^-24 ~ 6e-8.
# Over 5 steps that is < ~1e-6 of the O(1) values; rtol 1e-5 / atol 1e-6 keep
# a margin yet catch a wrong term (weight decay alone moves p by lr*wd ~ 1e-3).
TOL32 = dict(rtol=1e-5, atol=1e-6)
TOL = {np.float64: TOL64, np.float32: TOL32}


def problem(dtype, key=0):
    r = np.random.default_rng([7, key])
    p0 = r.standard_normal(P)
    grads = [r.standard_normal(P) * (1 + k) for k in range(STEPS)]  # varying scale too
    return p0.astype(dtype), [g.astype(dtype) for g in grads]


# ---- references (PyTorch semantics, float64) ----------------------------------------
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


# ---- SGD kernel --------------------------------------------------------------------
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


# ---- AdamW kernel ------------------------------------------------------------------
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


# ---- optimizer classes -------------------------------------------------------------
def flat_with(device, p0):
    flat = FlatParams(device, [("a.weight", (5, 7)), ("a.bias", (2,))])
    assert flat.size == P
    flat.data[...] = p0
    return flat


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_class_matches_reference(dtype, nesterov):
    cfg = OptimConfig(name="sgd", momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    device = CpuDevice(dtype)
    p0, grads = problem(np.dtype(dtype).type, key=3)
    flat = flat_with(device, p0)
    opt = make_optimizer(device, flat, cfg)
    assert isinstance(opt, SGD)
    for g, lr in zip(grads, LRS):
        flat.grad[...] = g
        opt.step(lr)
    ref_p, ref_buf = sgd_ref(p0, grads, LRS, 0.9, 0.01, nesterov)
    tol = TOL[np.dtype(dtype).type]
    np.testing.assert_allclose(flat.data, ref_p, **tol)
    assert set(opt.state()) == {"momentum"}
    np.testing.assert_allclose(opt.state()["momentum"], ref_buf, **tol)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("freeze_step", [0, 2])
def test_adamw_class_matches_reference_and_counts_steps(dtype, freeze_step):
    cfg = OptimConfig(name="adamw", beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, freeze_step=freeze_step)
    device = CpuDevice(dtype)
    p0, grads = problem(np.dtype(dtype).type, key=4)
    flat = flat_with(device, p0)
    opt = make_optimizer(device, flat, cfg)
    assert isinstance(opt, AdamW) and opt.t == 0
    for step, (g, lr) in enumerate(zip(grads, LRS)):
        flat.grad[...] = g
        opt.step(lr, step)
    assert opt.t == STEPS
    ref_p, ref_m, ref_v = adamw_ref(p0, grads, LRS, 0.9, 0.99, 1e-8, 0.01, freeze_step)
    tol = TOL[np.dtype(dtype).type]
    np.testing.assert_allclose(flat.data, ref_p, **tol)
    state = opt.state()
    assert set(state) == {"exp_avg", "exp_avg_sq"}
    np.testing.assert_allclose(state["exp_avg"], ref_m, **tol)
    np.testing.assert_allclose(state["exp_avg_sq"], ref_v, **tol)


# ---- learning-rate schedule --------------------------------------------------------
def sched(total=100, peak=1.0, **kw):
    return LRSchedule(dataclasses.replace(OptimConfig(), **kw), peak=peak, total_steps=total)


@pytest.mark.parametrize("schedule", ["cosine", "step", "constant"])
def test_warmup_is_linear_from_peak_over_warmup(schedule):
    s = sched(total=100, peak=2.0, schedule=schedule, warmup_steps=4, step_size=10)
    # step k of a warmup uses peak * (k+1) / warmup: never 0, reaches peak at the last warmup step
    np.testing.assert_allclose([s.lr(k) for k in range(5)], [0.5, 1.0, 1.5, 2.0, 2.0], rtol=1e-15)


def test_no_warmup_starts_at_peak():
    s = sched(total=50, schedule="cosine", warmup_steps=0)
    assert s.lr(0) == 1.0


def test_cosine_reaches_min_lr_at_the_last_step():
    # documented: "cosine from peak (end of warmup) to min_lr (last step)";
    # lr(step) takes the 0-based step about to run, so the last step is total-1
    total, warmup = 111, 10
    s = sched(total=total, schedule="cosine", warmup_steps=warmup, min_lr=0.01)
    assert s.lr(warmup) == pytest.approx(1.0, rel=1e-15)
    assert s.lr(total - 1) == pytest.approx(0.01, rel=1e-12)


def test_cosine_midpoint_is_mean_of_peak_and_min():
    # halfway between the first post-warmup step (peak) and the last step (min_lr)
    total, warmup = 111, 10
    s = sched(total=total, schedule="cosine", warmup_steps=warmup, min_lr=0.01)
    mid = warmup + (total - 1 - warmup) // 2
    assert s.lr(mid) == pytest.approx((1.0 + 0.01) / 2, rel=1e-12)


def test_cosine_is_monotone_and_clamped_at_min_lr():
    s = sched(total=60, schedule="cosine", warmup_steps=5, min_lr=0.1)
    lrs = np.array([s.lr(k) for k in range(5, 60)])
    assert np.all(np.diff(lrs) < 0)
    assert np.all(lrs >= 0.1)
    # beyond the planned steps (e.g. a resumed run with more steps) it stays at min_lr
    assert s.lr(60) == pytest.approx(0.1, rel=1e-15)
    assert s.lr(1000) == pytest.approx(0.1, rel=1e-15)


def test_step_schedule_decays_by_gamma_every_step_size():
    s = sched(total=100, schedule="step", warmup_steps=2, step_size=3, gamma=0.1)
    expected = [0.5, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.001]
    np.testing.assert_allclose([s.lr(k) for k in range(12)], expected, rtol=1e-12)


def test_constant_schedule_stays_at_peak():
    s = sched(total=10, schedule="constant", warmup_steps=3)
    np.testing.assert_allclose([s.lr(k) for k in range(3, 50)], 1.0, rtol=0)


@pytest.mark.parametrize("scale_lr, global_batch, expected", [
    (False, 1024, 0.1),            # the configured lr as is
    (True, 256, 0.1),              # at the base batch: unchanged
    (True, 1024, 0.4),             # 4x the batch -> 4x the lr
    (True, 64, 0.025),
])
def test_peak_lr_linear_scaling_rule(scale_lr, global_batch, expected):
    cfg = OptimConfig(lr=0.1, scale_lr=scale_lr, base_batch=256)
    assert peak_lr(cfg, global_batch) == pytest.approx(expected, rel=1e-15)

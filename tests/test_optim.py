"""Optimizer classes and the LR schedule against NumPy/closed-form references (the update ops inside
them, with the references, are tests/test_sgd.py's and test_adamw.py's)."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

from hpctrain.training.config import OptimConfig
from hpctrain.device import CpuDevice
from hpctrain.nn import FlatParams
from hpctrain.optim import SGD, AdamW, LRSchedule, make_optimizer, peak_lr
from kernel_checks import LRS, P, STEPS, TOL, problem
from test_adamw import adamw_ref
from test_sgd import sgd_ref

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

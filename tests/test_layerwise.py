"""LAMB and LARS (hpctrain/optim/layerwise.py) against NumPy references written from the papers' update
rules (You et al. 2017, Algorithm 1; You et al. 2019, Algorithm 2 with Adam's bias corrections),
on one rank in float64 (LAMB's direction kernel on its own is tests/test_lamb.py's). The sharded
and split runs are tests/test_mpi_layerwise.py."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.device import CpuDevice
from hpctrain.nn.flat import FlatParams
from hpctrain.optim import make_optimizer
from hpctrain.training.config import OptimConfig

SPECS = [("w", (6, 5)), ("b", (5,)), ("z", (4, 3)), ("v", (7,))]   # b: no decay; z: starts at zero
NO_DECAY = frozenset({"b"})


def _setup(name, **optim):
    cfg = OptimConfig()
    cfg.name, cfg.weight_decay, cfg.beta2, cfg.momentum = name, 0.1, 0.99, 0.9
    for key, value in optim.items():
        setattr(cfg, key, value)
    device = CpuDevice("float64")
    flat = FlatParams(device, SPECS)
    rng = np.random.default_rng(4)
    flat.data[...] = rng.standard_normal(flat.size)
    flat.view(flat.data, "z")[...] = 0.0
    return cfg, flat, make_optimizer(device, flat, cfg, NO_DECAY), rng


def _norm(x):
    return float(np.sqrt(np.sum(np.asarray(x, np.float64) ** 2)))


def lars_reference(w, g, v, lr, cfg, excluded):
    """You et al. 2017, Algorithm 1 (momentum form): local lr = eta ||w|| / (||g|| + beta ||w||),
    v = m v + lr local (g + beta w), w = w - v; biases and LayerNorm parameters: plain momentum SGD
    without decay (local = 1)."""
    beta = 0.0 if excluded else cfg.weight_decay
    wn, gn = _norm(w), _norm(g)
    local = cfg.trust_coefficient * wn / (gn + beta * wn) if wn > 0 and gn + beta * wn > 0 and not excluded else 1.0
    v = cfg.momentum * v + lr * local * (g + beta * w)
    return w - v, v


def lamb_reference(w, g, m, v, t, lr, cfg, excluded):
    """You et al. 2019, Algorithm 2 with bias corrections: r = m_hat / (sqrt(v_hat) + eps) + wd w,
    w = w - lr phi(||w||) / ||r|| r with phi the identity; excluded parameters: ratio 1, no decay."""
    wd = 0.0 if excluded else cfg.weight_decay
    m = cfg.beta1 * m + (1 - cfg.beta1) * g
    v = cfg.beta2 * v + (1 - cfg.beta2) * g * g
    m_hat, v_hat = m / (1 - cfg.beta1 ** t), v / (1 - cfg.beta2 ** t)
    r = m_hat / (np.sqrt(v_hat) + cfg.eps) + wd * w
    wn, rn = _norm(w), _norm(r)
    ratio = wn / rn if wn > 0 and rn > 0 and not excluded else 1.0
    return w - lr * ratio * r, m, v, ratio


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_updates_follow_the_published_rules(name):
    """Four steps with a changing learning rate: every parameter equals the reference's (rtol 1e-12),
    the zero-initialised one included (its first ratio is 1)."""
    cfg, flat, opt, rng = _setup(name)
    ref = {n: flat.view(flat.data, n).copy() for n, _ in SPECS}
    state = {n: [np.zeros(shape), np.zeros(shape)] for n, shape in SPECS}
    for t, lr in enumerate((0.01, 0.02, 0.05, 0.03), start=1):
        flat.grad[...] = rng.standard_normal(flat.size)
        grads = {n: flat.grad_view(n).copy() for n, _ in SPECS}
        opt.step(lr, t - 1)
        for n, _ in SPECS:
            if name == "lars":
                ref[n], state[n][0] = lars_reference(ref[n], grads[n], state[n][0], lr, cfg, n in NO_DECAY)
            else:
                ref[n], state[n][0], state[n][1], ratio = lamb_reference(ref[n], grads[n], *state[n], t, lr, cfg,
                                                                          n in NO_DECAY)
            np.testing.assert_allclose(flat.view(flat.data, n), ref[n], rtol=1e-12, atol=1e-15,
                                       err_msg=f"{name} step {t} {n}")
    assert opt.ratios[[n for n, _ in SPECS].index("b")] == 1.0   # excluded: unscaled
    assert not np.allclose(opt.ratios, 1.0)


def test_lambs_direction_array_is_counted_in_the_optimizer_memory():
    from types import SimpleNamespace

    from hpctrain.observe import memory

    for name, arrays in (("lamb", 3), ("lars", 1), ("adamw", 2)):
        cfg, flat, opt, _ = _setup(name)
        got = memory.computed(SimpleNamespace(flat=flat), opt, CpuDevice("float64"), 1)
        assert got["optimizer"] == arrays * flat.size * 8, name


def test_lamb_and_lars_are_refused_where_they_cannot_run():
    from hpctrain.errors import ConfigError
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.optim.name, cfg.optim.nesterov = "lars", True
    with pytest.raises(ConfigError, match="heavy-ball momentum"):
        cfg.validate()
    cfg = Config()
    cfg.optim.name, cfg.optim.freeze_step = "lamb", 5
    with pytest.raises(ConfigError, match="freezes AdamW's second moment"):
        cfg.validate()
    cfg = Config()
    cfg.optim.name, cfg.optim.trust_coefficient = "lars", 0.0
    with pytest.raises(ConfigError, match="trust_coefficient"):
        cfg.validate()

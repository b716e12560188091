"""The MLP model (hpctrain/models/mlp.py) end to end: its flat gradient against finite differences
of the mean loss, gradient accumulation, and one step on the CUDA device equal to the CPU's.
The ops inside it are tests/test_linear.py's, test_bias_act.py's and test_softmax_xent.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.device import CpuDevice
from hpctrain.kernels import sgd
from hpctrain.models.mlp import MLP
from kernel_checks import FD_TOL, TIGHT, fd_grad, needs_cuda, rng_cuda, rng_for


# ---- CPU ---------------------------------------------------------------------------------
def small_mlp(activation, n_in=5, hidden=(7, 6), classes=4, seed=3):
    model = MLP(CpuDevice("float64"), n_in, list(hidden), classes, activation=activation)
    model.init(seed)
    return model


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("batch", [1, 5])
def test_mlp_gradient_matches_finite_differences_of_mean_loss(activation, batch):
    model = small_mlp(activation)
    r = rng_for(16, batch)
    x = r.standard_normal((batch, 5))
    y = r.integers(0, 4, size=batch).astype(np.int64)
    model.flat.grad[...] = np.nan
    model.forward(x, y)
    model.backward()
    analytic = model.flat.grad.copy()

    def terms():  # mean loss = loss_sum / B
        return model.forward(x, y)[0] / batch

    numeric = fd_grad(terms, model.flat.data)
    assert np.all(np.isfinite(analytic))
    np.testing.assert_allclose(analytic, numeric, **FD_TOL)
    # every parameter slot gets a gradient (no layer skipped)
    for slot in model.flat.slots:
        assert np.any(model.flat.view(model.flat.grad, slot.name) != 0), slot.name


def test_mlp_backward_accumulate_sums_two_batches():
    model = small_mlp("gelu")
    r = rng_for(17)
    x1, x2 = r.standard_normal((4, 5)), r.standard_normal((4, 5))
    y1, y2 = r.integers(0, 4, size=4), r.integers(0, 4, size=4)
    grads = []
    for x, y in ((x1, y1), (x2, y2)):
        model.forward(x, y)
        model.backward()
        grads.append(model.flat.grad.copy())
    model.forward(x1, y1)
    model.backward()
    model.forward(x2, y2)
    model.backward(accumulate=True)
    np.testing.assert_allclose(model.flat.grad, grads[0] + grads[1], rtol=1e-13, atol=1e-15)


# ---- CUDA against the CPU ----------------------------------------------------------------
@needs_cuda
def test_mlp_step_on_cuda_equals_cpu_step(dev64):
    """forward, backward and an SGD update of a 2-hidden-layer MLP, float64."""
    r = rng_cuda(9)
    x, y = r.standard_normal((12, 8)), r.integers(0, 4, size=12).astype(np.int64)
    results = []
    for dev in (CpuDevice("float64"), dev64):
        model = MLP(dev, 8, [16, 9], 4, activation="gelu")
        model.init(5)
        loss, correct = model.forward(dev.from_host(x), dev.from_host(y, np.int64))
        model.backward()
        grad = dev.to_host(model.flat.grad).copy()
        dev.ops.sgd_update(model.flat.data, model.flat.grad, dev.zeros(model.flat.size),
                           dev.from_host(sgd.hyperparameters(dev.dtype, 0.1, 0.9, 0.0)), False)
        results.append((loss, correct, grad, dev.to_host(model.flat.data).copy()))
    (l0, c0, g0, p0), (l1, c1, g1, p1) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-12)
    assert c1 == c0
    np.testing.assert_allclose(g1, g0, **TIGHT)
    np.testing.assert_allclose(p1, p0, **TIGHT)

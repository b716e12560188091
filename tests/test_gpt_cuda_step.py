"""A whole GPT step on the CUDA device equals the same step on the CPU (float64).

Without a GPU the device is numba's CUDA simulator (tiny shapes: every simulated thread
runs interpreted Python); on a GPU machine scripts/test.sh and scripts/gpu-check.sh run the
same tests on the GPU, there with the GEMMs through cuBLAS as well (train.gemm). Two
micro-batches, the second accumulating into the gradient, then AdamW. Everything the GPT runs is on the device: embedding, layernorm,
attention (the CUDA kernels keep one log-sum-exp per row where the CPU twin keeps P),
GELU, residual adds, the tied head's GEMMs, the loss and AdamW.

Tolerance: float64, rtol 1e-11, and an absolute term of 1e-11 x the array's largest
value for entries that cancel to ~0 (a bias gradient of 1e-14 carries the rounding of its
O(0.01) terms). The two sides differ only in summation order (GEMM tiles, the attention's
online softmax, the reductions' trees) and fused multiply-adds: rounding at 2^-53 per
operation over sums of at most a few hundred terms.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.training.config import Config
from hpctrain.device import CpuDevice, CudaDevice, cuda_status
from hpctrain.kernels import adamw
from hpctrain.models.gpt import GPT

pytestmark = [pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}"),
              pytest.mark.timeout(600)]

VOCAB, T, LAYERS, HEADS, D = 13, 7, 2, 2, 6   # head size 3, T not a multiple of any tile


def assert_close(got, ref):
    np.testing.assert_allclose(got, ref, rtol=1e-11, atol=1e-11 * np.abs(ref).max())


def _step(dev, tokens, targets):
    """Two micro-batches (the second's gradient accumulated), then AdamW."""
    model = GPT(dev, VOCAB, T, LAYERS, HEADS, D)
    model.init(3)
    for i, rows in enumerate((slice(0, 2), slice(2, None))):
        loss, correct = model.forward(dev.from_host(tokens[rows], np.int64), dev.from_host(targets[rows], np.int64))
        model.backward(accumulate=i > 0)
    grad = dev.to_host(model.flat.grad).copy()
    state = [dev.zeros(model.flat.size) for _ in range(2)]
    dev.ops.adamw_update(model.flat.data, model.flat.grad, *state,
                         dev.from_host(adamw.hyperparameters(dev.dtype, 1, 1e-2, 0.9, 0.95, 1e-8, 0.1)))
    return loss, correct, grad, dev.to_host(model.flat.data).copy()


def _gemms():
    """numba's GEMM everywhere; cuBLAS too where CuPy runs (a real GPU)."""
    from hpctrain.device import simulated
    from hpctrain.kernels.support.cublas import cupy_status

    real = not simulated() and cupy_status()[0]
    return [pytest.param("numba"),
            pytest.param("cublas", marks=pytest.mark.skipif(not real, reason="CuPy on a real GPU only"))]


@pytest.mark.parametrize("gemm, attention", [pytest.param(*p.values, "flash", marks=p.marks) for p in _gemms()]
                         + [("auto", "gemm")])
def test_gpt_step_on_cuda_equals_cpu_step(gemm, attention):
    # attention = gemm: its GEMMs on cuBLAS on a GPU (a GPU without CuPy refuses it: skipped), NumPy on
    # the simulator
    r = np.random.default_rng(17)
    tokens = r.integers(0, VOCAB, (3, T))
    tokens[1] = 4   # one window of a single repeated token: the embedding gradient's worst case
    targets = r.integers(0, VOCAB, (3, T))
    (l0, c0, g0, p0), (l1, c1, g1, p1) = (_step(d, tokens, targets) for d in (CpuDevice("float64"),
                                                                               _cuda(gemm, attention)))
    np.testing.assert_allclose(l1, l0, rtol=1e-12)
    assert c1 == c0
    assert_close(g1, g0)
    assert_close(p1, p0)
    assert np.abs(g0).max() > 1e-3   # a real gradient, not zeros on both sides


def _cuda(gemm, attention):
    from hpctrain.errors import ConfigError

    try:
        return CudaDevice("float64", gemm=gemm, attention=attention)
    except ConfigError as exc:
        pytest.skip(str(exc))


def _config(text, device, steps=2):
    """A tiny GPT run for the trainer-level check (tests/test_mpi_gpt_cuda.py)."""
    cfg = Config()
    cfg.model.kind = "gpt"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 1, 2, 6, 5
    cfg.data.train = text
    cfg.train.global_batch, cfg.train.steps, cfg.train.dtype, cfg.train.device = 4, steps, "float64", device
    cfg.train.log_every, cfg.train.eval_tokens = 10**6, 64
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps = "adamw", 1e-2, 0
    cfg.dist.auto_cache = ""
    cfg.checkpoint.dir, cfg.checkpoint.keep_last, cfg.checkpoint.every_minutes = "/tmp/hpctrain-unused", 0, 0
    return cfg.validate()


def test_launches_are_counted_the_same_for_the_same_work(monkeypatch):
    """The device counts the host's kernel launches, cuBLAS calls and graph replays (the metrics'
    ``launches`` per step: tests/test_training_parts.py): a forward and backward counts the same
    every time, and a deeper model more. (On the simulator the kernels are launched but not run:
    what is counted is the host's calls, and running them took 30 s.)"""
    from hpctrain.device import simulated
    from hpctrain.kernels.support import cuda_support

    if simulated():
        from numba.cuda.simulator import kernel as sim

        run = sim.FakeCUDAKernel.__call__
        monkeypatch.setattr(sim.FakeCUDAKernel, "__call__", lambda k, *args: run(k, *args) if k._device else None)
    dev = CudaDevice("float64")
    tokens = dev.from_host(np.zeros((2, T), np.int64), np.int64)
    counts = {}
    for layers in (1, 2):
        model = GPT(dev, VOCAB, T, layers, HEADS, D)
        model.init(3)
        counts[layers] = []
        for _ in range(2):
            before = dev.launches()
            model.forward(tokens, tokens)
            model.backward()
            counts[layers].append(dev.launches() - before)
    assert counts[1][0] == counts[1][1] > 10 and counts[2][0] == counts[2][1] > counts[1][0], counts
    before = cuda_support.launches()
    dev.ops.scale(dev.zeros(5), 2.0)
    assert cuda_support.launches() - before == 1

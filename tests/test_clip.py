"""Gradient-norm clipping (optim.clip_grad_norm, hpctrain/training/clip.py), on one process.

Which elements each rank counts (every logical element once over the world), the coefficient
(PyTorch's clip_grad_norm_), and one rank's clipping of a real gradient against NumPy. The
N-rank, ZeRO and tensor-parallel runs against the 1-rank clipped run are tests/test_mpi_clip.py;
the last test clips on the CUDA device (the simulator here).
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from conftest import up
from hpctrain.device import CudaDevice
from hpctrain.errors import ConfigError
from hpctrain.nn.flat import ParamSlot
from hpctrain.training.clip import EPS, GradClip, clip_coefficient, counted_runs
from kernel_checks import needs_cuda, rng_cuda

SLOTS = [ParamSlot("w1", (4, 3), 0, 12), ParamSlot("ln", (3,), 12, 3), ParamSlot("w2", (3, 2), 15, 6),
         ParamSlot("b2", (2,), 21, 2)]
SPLIT = {"w1", "w2"}


def test_each_element_is_counted_by_exactly_one_rank_of_the_world():
    whole = [(0, 23)]
    owned = {0: [(0, 7), (14, 16)], 1: [(7, 14), (16, 23)]}   # ZeRO: two data ranks' chunks of two buckets
    for sharded in (False, True):
        counts = np.zeros(23, int)      # per logical element; split parameters' elements are per tensor rank
        split_counts = {}
        for data_rank in (0, 1):
            for tensor_rank in (0, 1):
                ranges = owned[data_rank] if sharded else whole
                for lo, hi in counted_runs(ranges, SLOTS, SPLIT, sharded, data_rank, tensor_rank):
                    for i in range(lo, hi):
                        name = next(s.name for s in SLOTS if s.offset <= i < s.offset + s.size)
                        if name in SPLIT:   # a different piece on each tensor rank: each counted once
                            split_counts[(tensor_rank, i)] = split_counts.get((tensor_rank, i), 0) + 1
                        else:
                            counts[i] += 1
        replicated = [i for s in SLOTS if s.name not in SPLIT for i in range(s.offset, s.offset + s.size)]
        assert all(counts[i] == 1 for i in replicated), (sharded, counts)
        split = [(t, i) for t in (0, 1) for s in SLOTS if s.name in SPLIT for i in range(s.offset, s.offset + s.size)]
        assert all(split_counts.get(k) == 1 for k in split) and len(split_counts) == len(split), sharded


def test_runs_are_merged_where_they_touch():
    assert counted_runs([(0, 23)], SLOTS, set(), False, 0, 0) == [(0, 23)]
    assert counted_runs([(0, 23)], SLOTS, SPLIT, False, 0, 1) == [(0, 12), (15, 21)]
    assert counted_runs([(0, 23)], SLOTS, SPLIT, False, 1, 0) == []


def test_the_coefficient_is_pytorchs():
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == 1.0 / (4.0 + EPS)
    assert clip_coefficient(float("nan"), 1.0) == 1.0 and clip_coefficient(float("inf"), 1.0) == 1.0


class _OneRank:
    """A world of one rank: its all-gather is its own value."""
    rank, size = 0, 1
    comm = types.SimpleNamespace(allgather=lambda value: [value])


@pytest.mark.parametrize("max_norm", [1e9, 0.3])
def test_one_rank_clips_a_gpt_gradient_as_numpy_does(max_norm):
    from hpctrain.device import CpuDevice
    from hpctrain.models.gpt import GPT

    dev = CpuDevice("float64")
    model = GPT(dev, 29, 16, 2, 2, 8)
    model.init(1)
    r = np.random.default_rng(2)
    model.forward(r.integers(0, 29, (3, 16)), r.integers(0, 29, (3, 16)))
    model.backward()
    g = model.flat.grad.copy()
    plan = types.SimpleNamespace(device=dev, world=_OneRank(), shards=None, dp=_OneRank(),
                                 grid=types.SimpleNamespace(tensor_rank=0, stage=0))
    clip = GradClip(plan, model, lambda lo, hi: model.flat.grad[lo:hi], [(0, 100), (100, model.flat.size)], max_norm)
    norm = clip.apply()
    want = float(np.linalg.norm(g))
    assert math.isclose(norm, want, rel_tol=1e-13) and want > 0.3
    c = min(1.0, max_norm / (want + EPS))
    np.testing.assert_allclose(model.flat.grad, g * c, rtol=1e-15, atol=0)
    assert clip.metrics() == {"grad_norm": norm, "grad_clip": clip.coefficient}
    assert (clip.coefficient < 1.0) == (max_norm < want)


def test_config_refuses_a_negative_or_non_finite_limit():
    from hpctrain.training.config import Config

    for bad in (-1.0, float("nan"), float("inf")):
        cfg = Config()
        cfg.optim.clip_grad_norm = bad
        with pytest.raises(ConfigError, match="optim.clip_grad_norm"):
            cfg.validate()


def test_a_non_finite_gradient_is_left_alone():
    from hpctrain.device import CpuDevice

    dev = CpuDevice("float32")
    g = np.ones(10, np.float32)
    g[3] = np.nan
    plan = types.SimpleNamespace(device=dev, world=_OneRank(), shards=None, dp=_OneRank(),
                                 grid=types.SimpleNamespace(tensor_rank=0, stage=0))
    model = types.SimpleNamespace(flat=types.SimpleNamespace(slots=[ParamSlot("w", (10,), 0, 10)]))
    clip = GradClip(plan, model, lambda lo, hi: g[lo:hi], [(0, 10)], 0.1)
    assert math.isnan(clip.apply()) and clip.coefficient == 1.0
    assert np.isnan(g[3]) and np.all(np.delete(g, 3) == 1.0)


def test_config_refuses_clipping_the_velocities_of_momentum_correction():
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.optim.name, cfg.optim.freeze_step = "adamw", 10
    cfg.dist.compress, cfg.dist.compress_momentum, cfg.dist.compress_start_step = "topk(0.01)", True, 10
    cfg.validate()   # the combination itself is valid
    cfg.optim.clip_grad_norm = 1.0
    with pytest.raises(ConfigError, match="clip_grad_norm=1.0 with dist.compress_momentum"):
        cfg.validate()


@needs_cuda
def test_gradient_clipping_on_the_device_matches_numpy():
    dev = CudaDevice("float32")
    g = rng_cuda(11).standard_normal(600).astype(np.float32)
    grad = up(dev, g)
    one = types.SimpleNamespace(rank=0, size=1, comm=types.SimpleNamespace(allgather=lambda value: [value]))
    plan = types.SimpleNamespace(device=dev, world=one, shards=None, dp=one, grid=types.SimpleNamespace(tensor_rank=0, stage=0))
    model = types.SimpleNamespace(flat=types.SimpleNamespace(slots=[ParamSlot("w", (600,), 0, 600)]))
    clip = GradClip(plan, model, lambda lo, hi: grad[lo:hi], [(0, 250), (250, 600)], 2.0)
    norm = clip.apply()
    want = float(np.linalg.norm(g.astype(np.float64)))
    assert math.isclose(norm, want, rel_tol=1e-12) and clip.coefficient < 1.0
    np.testing.assert_array_equal(dev.to_host(grad), g * np.float32(2.0 / (want + EPS)))

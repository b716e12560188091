"""Gradient-norm clipping across ranks (run under mpirun -n 1..4): a clipped N-rank run, with
ZeRO-1, ZeRO-2 or tensor parallelism, trains like the 1-rank clipped run with the whole batch.

Every rank also trains the 1-rank reference itself on COMM_SELF. Float64, a GPT of several
buckets, a limit well under the gradient's norm (clipping in every step): the per-step norms
(metrics ``grad_norm``) and the final logical parameters agree to rtol 1e-10, the N-rank
equivalence tests' bound. The unclipped run ends elsewhere, so the comparison can fail.
"""

import json
import os

import numpy as np
import pytest

from hpctrain.training.config import Config

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

LIMIT = 0.05


def _config(data, metrics, zero=0, t=1, clip=LIMIT):
    cfg = Config()
    cfg.model.kind = "gpt"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 2, 16, 16
    cfg.data.train, cfg.train.eval_tokens = data, 256
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.02, 0.01  # ~9 K parameters: several buckets
    cfg.dist.allreduce, cfg.dist.zero, cfg.dist.tensor_parallel = "ring", zero, t
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = 24, 2, 4
    cfg.train.dtype, cfg.train.log_every, cfg.train.metrics = "float64", 10**6, metrics
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay = "adamw", 3e-3, 0, 0.1
    cfg.optim.clip_grad_norm = clip
    cfg.checkpoint.dir, cfg.checkpoint.keep_last = "/tmp/hpctrain-unused", 0
    cfg.checkpoint.every_minutes, cfg.checkpoint.save_final = 0, False
    return cfg.validate()


def _train(cfg, world):
    """(logical parameters by name, the metrics records with a norm) of a run on ``world`` (rank 0
    writes the metrics to a directory every rank sees)."""
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    trainer = Trainer(cfg, world, Log(False))
    trainer.run()
    model, out = trainer.model, {}
    for s in model.flat.slots:
        local = np.array(model.flat.view(model.flat.data, s.name))
        out[s.name] = local if model.tensor_layout is None else model.tensor_layout.logical(s.name, local)
    world.comm.Barrier()
    return out, [r for r in map(json.loads, open(cfg.train.metrics)) if "grad_norm" in r]


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.fixture(scope="module")
def reference(world, mpi_text_data, mpi_shared_dir):
    """The 1-rank clipped run (every rank its own, on COMM_SELF) and the 1-rank unclipped one."""
    from mpi4py import MPI

    from hpctrain.runtime import init_world

    alone = init_world(MPI.COMM_SELF)
    path = os.path.join(mpi_shared_dir, f"ref-{world.rank}")
    clipped = _train(_config(mpi_text_data, path + "-clipped.jsonl"), alone)
    unclipped = _train(_config(mpi_text_data, path + "-unclipped.jsonl", clip=0.0), alone)
    return clipped, unclipped


def _same(got, want):
    (params, records), (ref_params, ref_records) = got, want
    assert set(params) == set(ref_params)
    for name in params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-10, atol=1e-13, err_msg=name)
    assert [r["step"] for r in records] == [r["step"] for r in ref_records] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["grad_norm"] for r in records], [r["grad_norm"] for r in ref_records],
                               rtol=1e-10)


def test_the_reference_clips_every_step_and_clipping_changes_the_result(reference):
    (params, records), (free, free_records) = reference
    assert all(r["grad_norm"] > LIMIT and r["grad_clip"] < 1.0 for r in records)
    assert free_records == []   # no norm is computed (or reported) without clipping
    moved = max(float(np.max(np.abs(params[n] - free[n]))) for n in params)
    assert moved > 1e-5


@pytest.mark.parametrize("zero,t", [(0, 1), (1, 1), (2, 1), (0, 2)])   # ZeRO with t > 1 is refused
def test_n_ranks_clip_like_one_rank(world, mpi_text_data, mpi_shared_dir, reference, zero, t):
    if t > world.size or world.size % t:
        pytest.skip(f"t = {t} needs a multiple of {t} ranks (this job has {world.size})")
    metrics = os.path.join(mpi_shared_dir, f"clip-z{zero}-t{t}.jsonl")
    _same(_train(_config(mpi_text_data, metrics, zero=zero, t=t), world), reference[0])

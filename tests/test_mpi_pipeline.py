"""Pipeline parallelism (``dist.pipeline_parallel = p``) against data parallelism, inside one MPI job
(run under mpirun -n 1..4; a case needs p x t to divide the world size).

The reference is the same job with p = 1, which trains like one rank with the whole batch (the
N-rank equivalence tests). Float64 throughout: a stage boundary changes no arithmetic, but the tied
table's two gradients (the head's and the embedding's) are averaged over the data group each on its
own and then added, where one rank adds them first, so parameters and losses agree to rtol 1e-10,
not bit for bit.
"""

import os
import zlib

import numpy as np
import pytest

from hpctrain.errors import UserError
from hpctrain.training.config import Config
from whole_model import train as _train, whole as _whole

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _config(data, p, t=1, schedule="1f1b", steps=3, optim="adamw", recompute="none", m=4, zero=0, clip=0.0,
            ckpt_dir="/tmp/hpctrain-unused", resume="", n_layer=4, precision="fp32", metrics="", batch=16,
            loss_scale=65536.0):
    cfg = Config()
    cfg.model.kind, cfg.model.recompute = "gpt", recompute
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = n_layer, 4, 16, 16
    cfg.data.train, cfg.train.eval_tokens = data, 256
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.02, 0.01  # several buckets
    cfg.dist.allreduce, cfg.dist.zero, cfg.dist.tensor_parallel = "ring", zero, t
    cfg.dist.pipeline_parallel, cfg.dist.pipeline_schedule = p, schedule
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = batch, m, steps
    cfg.train.loss_scale = loss_scale
    cfg.train.dtype, cfg.train.log_every, cfg.train.precision = "float64", 10**6, precision
    cfg.train.metrics = metrics
    if precision != "fp32":
        cfg.train.dtype = "float32"
    cfg.optim.name, cfg.optim.warmup_steps, cfg.optim.weight_decay = optim, 2, 0.1
    cfg.optim.lr, cfg.optim.clip_grad_norm = (0.05 if optim == "sgd" else 3e-3), clip
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = ckpt_dir, resume, 0
    cfg.checkpoint.every_minutes, cfg.checkpoint.save_final = 0, ckpt_dir != "/tmp/hpctrain-unused"
    return cfg.validate()




def _records(path):
    """The step records of a metrics file (rank 0 writes it; read on every rank after a barrier)."""
    import json

    with open(path) as fh:
        return [r for r in map(json.loads, fh) if "loss" in r]


def _losses(path):
    return [r["loss"] for r in _records(path)]




@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def _need(world, ranks):
    if world.size % ranks:
        pytest.skip(f"needs a multiple of {ranks} ranks (this job has {world.size})")


CASES = [  # (p, t, schedule, optim, recompute, zero, clip, global batch)
    (2, 1, "1f1b", "adamw", "none", 0, 0.0, 16),
    (2, 1, "gpipe", "sgd", "blocks", 0, 0.0, 16),
    (4, 1, "1f1b", "adamw", "blocks", 0, 0.0, 16),
    (4, 1, "gpipe", "sgd", "none", 0, 0.0, 16),
    (2, 2, "1f1b", "adamw", "none", 0, 0.0, 16),
    (2, 1, "1f1b", "adamw", "none", 1, 0.02, 16),
    (2, 1, "gpipe", "adamw", "none", 2, 0.0, 16),
    (2, 1, "1f1b", "sgd", "blocks", 0, 0.0, 18),   # micro-batches of 5, 5, 4, 4 rows (3, 2, 2, 2 at d = 2)
]


@pytest.mark.parametrize("p,t,schedule,optim,recompute,zero,clip,batch", CASES)
def test_pipeline_trains_like_data_parallel(world, mpi_text_data, p, t, schedule, optim, recompute, zero, clip,
                                            batch):
    """3 steps of m = 4 micro-batches with p stages (and t-way tensor groups inside them, the rest of
    the world data-parallel): the whole model's parameters, the optimizer state (rtol 1e-9: Adam's
    second moment squares the gradient's rounding), the step losses and the evaluation loss equal
    the p = 1 data-parallel run's (rtol 1e-10); the first and last stages' copies of the tied table
    are the same bits."""
    _need(world, p * t)
    if zero and world.size // p < 2:
        pytest.skip("ZeRO shares need data groups of 2 or more")
    from conftest import fresh_shared_dir

    d = fresh_shared_dir(world, f"pp-{p}-{t}-{schedule}-{optim}-{recompute}-{zero}-{batch}")
    piped, piped_result = _train(_config(mpi_text_data, p, t, schedule, optim=optim, recompute=recompute,
                                         zero=zero, clip=clip, metrics=f"{d}/piped.jsonl", batch=batch), world)
    flat_, flat_result = _train(_config(mpi_text_data, 1, t, optim=optim, recompute=recompute, zero=zero,
                                        clip=clip, metrics=f"{d}/flat.jsonl", batch=batch), world)
    world.comm.Barrier()
    grid = piped.plan.grid
    assert grid.p == p and piped.plan.dp.size == world.size // (p * t)
    assert piped.stepper.runner.stage.lanes == (4 if schedule == "gpipe" else min(p - grid.stage, 4))
    got, want = _whole(piped), _whole(flat_)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)
    if zero == 0:   # (ZeRO's shares: tests/test_mpi_zero.py checks them against zero 0)
        for state, buf in piped.optimizer.state().items():
            got_s, want_s = _whole(piped, buf), _whole(flat_, flat_.optimizer.state()[state])
            for name in want_s:
                np.testing.assert_allclose(got_s[name], want_s[name], rtol=1e-9, atol=1e-14, err_msg=f"{state} {name}")
    got_losses, want_losses = _losses(f"{d}/piped.jsonl"), _losses(f"{d}/flat.jsonl")
    assert len(got_losses) == 3 and got_losses == pytest.approx(want_losses, rel=1e-10)
    assert piped_result["eval"]["loss"] == pytest.approx(flat_result["eval"]["loss"], rel=1e-10)
    a, b = piped.evaluate(), flat_.evaluate()
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-10)
    # the activations each stage held after step 1 (before any evaluation), measured on the arrays,
    # against the bytes the plan computes for its schedule's micro-batches in flight
    from hpctrain.training.plan import memory_of

    first = _records(f"{d}/piped.jsonl")[0]
    if batch % (world.size // (p * t) * 4) == 0:   # (memory_of counts the largest micro-batch, every lane alike)
        computed = memory_of(piped.plan, piped.model, piped.optimizer, piped.state.sampler)["activations"]
        assert first["pipeline_activation_bytes"] == grid.pipeline.comm.allgather(computed)
    assert len(first["pipeline_idle"]) == p and all(0 <= idle < 1 for idle in first["pipeline_idle"])
    if clip:
        assert piped.stepper.clip.norm == pytest.approx(flat_.stepper.clip.norm, rel=1e-10)
        assert piped.stepper.clip.coefficient < 1.0   # the limit bit
    if grid.embedding is not None:   # the tied table: the same bits on the first and the last stage
        table = np.ascontiguousarray(piped.model.flat.view(piped.model.flat.data, "wte"))
        assert len(set(grid.embedding.comm.allgather(zlib.crc32(table.tobytes())))) == 1


@pytest.mark.parametrize("precision,loss_scale", [("bf16", 65536.0), ("fp16", 2.0 ** 24)])
def test_a_16_bit_pipeline_runs_the_one_stage_arithmetic(world, mpi_text_data, precision, loss_scale):
    """Under train.precision = bf16 or fp16 the stage boundary is in the float32 residual stream, so
    p = 2 rounds where one stage does: the parameters stay within float32 rounding of the p = 1
    run's. fp16 starts from a loss scale of 2^24, which overflows some stages' gradients: every
    stage skips those steps together (the scale halved alike), and the later steps train. (Whether a
    16-bit gradient overflows depends on the rows of a rank's micro-batch, each loss being their
    mean: the p = 1 run, twice as many data-parallel ranks, takes half as many micro-batches so
    that both have 4 rows per micro-batch.)"""
    from conftest import fresh_shared_dir

    _need(world, 2)
    steps = 8 if precision == "fp16" else 3
    d, out = world.size // 2, fresh_shared_dir(world, f"pp-{precision}")
    piped, _ = _train(_config(mpi_text_data, 2, precision=precision, loss_scale=loss_scale, steps=steps,
                              m=16 // d // 4, optim="sgd", metrics=f"{out}/piped.jsonl"), world)
    flat_, _ = _train(_config(mpi_text_data, 1, precision=precision, loss_scale=loss_scale, steps=steps,
                              m=16 // (2 * d) // 4, optim="sgd", metrics=f"{out}/flat.jsonl"), world)
    world.comm.Barrier()
    if precision == "fp16":
        scale = piped.state.loss_scale.scale
        assert scale == flat_.state.loss_scale.scale and scale < loss_scale   # overflowed, alike
        assert len(set(world.comm.allgather(scale))) == 1
        skipped = [r["skipped"] for r in _records(f"{out}/piped.jsonl")]
        assert skipped == [r["skipped"] for r in _records(f"{out}/flat.jsonl")]
        assert any(skipped) and not all(skipped)   # some steps skipped, some applied
    got, want = _whole(piped), _whole(flat_)
    for name in want:
        # float32 sums in another order (the micro-batches' gradients added before or in the all-reduce):
        # 1e-5 of each parameter's norm (SGD: AdamW would blow the rounding of gradients that are zero
        # but for it, the attention's key biases', up to the learning rate); one step skipped on one
        # side but not the other would move every parameter by a whole update
        diff = np.linalg.norm(got[name] - want[name]) / np.linalg.norm(want[name])
        assert diff <= 1e-5, (name, diff)


@pytest.mark.parametrize("saved_p,loaded_p", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_at_another_p(world, mpi_text_data, saved_p, loaded_p):
    """Saved at step 2 with one p, resumed with the other to step 4: the parameters equal an
    uninterrupted p = 1 run's (rtol 1e-10); the file holds the whole model, as p = 1 writes it."""
    import h5py

    from conftest import fresh_shared_dir

    _need(world, 2)
    d = fresh_shared_dir(world, f"pp-{saved_p}-{loaded_p}")
    _train(_config(mpi_text_data, saved_p, steps=2, ckpt_dir=d), world)
    world.comm.Barrier()
    with h5py.File(os.path.join(d, "ckpt-00000002.h5")) as f:
        assert f["model/wte"].shape[1] == 16 and f["model/wpe"].shape == (16, 16)
        assert f["model/h/3/attn/c_attn/weight"].shape == (16, 48)
        assert f["optim/exp_avg/ln_f/weight"].shape == (16,)
    resumed, _ = _train(_config(mpi_text_data, loaded_p, steps=4, ckpt_dir=d, resume="auto"), world)
    assert resumed.checkpoints.saved_path is not None
    straight, _ = _train(_config(mpi_text_data, 1, steps=4), world)
    got, want = _whole(resumed), _whole(straight)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)


def test_bad_pipeline_sizes_are_one_clear_error(world, mpi_text_data):
    """p x t must divide the world size: the same message on every rank (the config refuses what
    does not depend on the world: tests/test_schedules.py)."""
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    p = world.size + 1   # never divides the world size
    cfg = _config(mpi_text_data, 1, n_layer=p)
    cfg.dist.pipeline_parallel = p
    with pytest.raises(UserError, match=f"^dist.pipeline_parallel={p} x dist.tensor_parallel=1 does not divide "
                                        f"the world size {world.size}"):
        Trainer(cfg.validate(), world, Log(False))

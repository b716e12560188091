"""Training with gradient compression (run under mpirun -n 1..4): every compressor with
every strategy and both scopes trains the MLP, keeps all ranks' parameters identical, and a
signal-stopped, resumed run with compression on is bit-exact, for the MLP and for the GPT
(with compression's warm-up and AdamW's frozen second moment crossed before the stop, with and
without momentum correction, whose velocities are part of the compressor's state).
The GPT's compressor-by-strategy matrix is test_mpi_compress_gpt.py."""

import hashlib
import os
import signal

import numpy as np
import pytest

from hpctrain.training.config import Config
from steps import train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

SPECS = ["fp16", "bf16", "topk(0.05)", "randk(0.2)", "sign", "powersgd(2)"]


def _config(train, compress, allreduce="mpi", scope="all", steps=12, ckpt_dir="/tmp/hpctrain-unused", resume="",
            model="mlp"):
    if model.startswith("gpt"):  # compression from step 3, the second moment frozen there too
        from tiny_gpt import gpt_config

        return gpt_config(train, compress, allreduce, scope, steps, optim={"freeze_step": 3},
                          dist={"compress_start_step": 3, "compress_momentum": model == "gpt+momentum"},
                          checkpoint={"dir": ckpt_dir, "resume": resume, "keep_last": 0})
    cfg = Config()
    cfg.data.train, cfg.data.eval = train, ""
    cfg.model.hidden = [16, 12]
    cfg.train.global_batch = 96
    cfg.train.steps, cfg.train.log_every, cfg.train.metrics = steps, 10**6, ""
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps = "adamw", 0.003, 2
    cfg.dist.allreduce, cfg.dist.compress, cfg.dist.compress_scope = allreduce, compress, scope
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.001, 0.001  # several buckets
    cfg.checkpoint.dir, cfg.checkpoint.resume = ckpt_dir, resume
    return cfg.validate()


def _trainer(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    return Trainer(cfg, world, Log(False))


@pytest.fixture(scope="module")
def node_world():
    from hpctrain.runtime import init_world

    return init_world(ranks_per_node=2)  # 2 simulated nodes from 3 ranks up


def _identical(world, a):
    digests = world.comm.allgather(hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
    assert len(set(digests)) == 1


def _losses(t, steps):
    out = []
    for _ in range(steps):
        loss = train_step(t).loss_sum
        out.append(loss)
    return out


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("allreduce,scope", [("mpi", "all"), ("ring", "all"), ("hierarchical", "all"),
                                             ("hierarchical", "inter")])
def test_every_compressor_strategy_and_scope_trains(node_world, mpi_small_data, spec, allreduce, scope):
    if scope == "inter" and spec.startswith("powersgd"):
        from hpctrain.errors import UserError
        with pytest.raises(UserError, match="powersgd"):
            _trainer(_config(mpi_small_data[0], spec, allreduce, scope), node_world)
        return
    t = _trainer(_config(mpi_small_data[0], spec, allreduce, scope), node_world)
    losses = _losses(t, 12)
    _identical(node_world, t.model.flat.data)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses  # it learns
    c = t.compression
    if node_world.size > 1 and (scope == "all" or node_world.n_nodes > 1) and c._sum is not None:
        assert 0 < c.sent_bytes < c.dense_bytes  # real payloads, smaller than float32


def test_inter_scope_on_one_node_compresses_nothing(mpi_small_data):
    """On one node nothing crosses a node: scope inter must equal no compression exactly."""
    from hpctrain.runtime import init_world

    world = init_world()
    plain = _trainer(_config(mpi_small_data[0], "none", "hierarchical"), world)
    inter = _trainer(_config(mpi_small_data[0], "topk(0.01)", "hierarchical", "inter"), world)
    _losses(plain, 5), _losses(inter, 5)
    np.testing.assert_array_equal(plain.model.flat.data, inter.model.flat.data)


@pytest.mark.parametrize("spec,allreduce,scope,model", [
    ("topk(0.05)", "mpi", "all", "mlp"), ("powersgd(2)", "mpi", "all", "mlp"), ("sign", "hierarchical", "inter", "mlp"),
    ("powersgd(2)", "ring", "all", "gpt"), ("topk(0.05)", "hierarchical", "inter", "gpt"),
    ("topk(0.05)", "mpi", "all", "gpt+momentum"), ("powersgd(2)", "ring", "all", "gpt+momentum")])
def test_resume_with_compression_is_bit_exact(node_world, mpi_small_data, mpi_text_data, spec, allreduce, scope,
                                              model):
    import shutil

    from hpctrain.ckpt.format import list_checkpoints

    world = node_world
    data = mpi_text_data if model.startswith("gpt") else mpi_small_data[0]
    d = world.comm.bcast(f"/tmp/hpctrain-compress-resume-{os.getpid()}" if world.rank == 0 else None)
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)
    world.comm.Barrier()
    n_steps, k = 14, 6
    straight = _trainer(_config(data, spec, allreduce, scope, n_steps, model=model), world)
    straight.run()
    first = _trainer(_config(data, spec, allreduce, scope, n_steps, ckpt_dir=d, model=model), world)
    step = first.stepper.run

    def signalled(at, x, y, votes=None):
        if first.step == k - 1 and world.rank == world.size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return step(at, x, y, votes)
    first.stepper.run = signalled
    assert first.run()["stopped_by"]
    assert [s for s, _ in list_checkpoints(d)] == [k]
    resumed = _trainer(_config(data, spec, allreduce, scope, n_steps, ckpt_dir=d, resume="auto", model=model), world)
    assert resumed.step == k
    restored = world.comm.allreduce(len(resumed.compression.state()))  # 0: nothing was compressed (one node)
    resumed.run()
    np.testing.assert_array_equal(resumed.model.flat.data, straight.model.flat.data)
    for name, buf in straight.optimizer.state().items():
        np.testing.assert_array_equal(resumed.optimizer.state()[name], buf)
    # without the compressor state the continuation differs (the test is not vacuous)
    if restored:
        fresh = _trainer(_config(data, spec, allreduce, scope, n_steps, ckpt_dir=d, resume="auto", model=model),
                         world)
        fresh.compression.load_state({})
        fresh.run()
        assert not np.array_equal(fresh.model.flat.data, straight.model.flat.data)
    if restored and model == "gpt+momentum":  # and so it does without the velocities alone
        still = _trainer(_config(data, spec, allreduce, scope, n_steps, ckpt_dir=d, resume="auto", model=model),
                         world)
        state = still.compression.state()
        assert any(k.startswith("velocity/") for k in state)
        still.compression.load_state({k: v for k, v in state.items() if not k.startswith("velocity/")})
        still.run()
        assert not np.array_equal(still.model.flat.data, straight.model.flat.data)
    world.comm.Barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def test_freeze_and_compression_start_at_the_same_global_step_past_a_skipped_step(mpi_small_data, monkeypatch):
    """dist.compress_start_step = optim.freeze_step = 3 with step 1 skipped by the guard (a NaN in
    rank 0's batch): AdamW's second moment takes steps 0 and 2 and is frozen from step 3 on, the
    step where compression starts, though only 2 updates came before it."""
    from hpctrain.runtime import init_world

    world = init_world()
    monkeypatch.setenv("HPCTRAIN_FAULT", "nan:1")
    cfg = _config(mpi_small_data[0], "topk(0.05)", steps=6)
    cfg.guard.nonfinite, cfg.optim.freeze_step, cfg.dist.compress_start_step = "skip", 3, 3
    t = _trainer(cfg.validate(), world)
    v_before, compute = {}, t.stepper.run  # v_before[s]: the second moment as step s starts

    def recording(at, x, y, votes=None):
        v_before[t.step] = t.optimizer.exp_avg_sq.copy()
        return compute(at, x, y, votes)
    t.stepper.run = recording
    t.run()
    v_before[6] = t.optimizer.exp_avg_sq.copy()
    assert t.guard.bad_steps == 1 and t.optimizer.t == 5 and sorted(v_before) == list(range(7))
    assert np.array_equal(v_before[2], v_before[1])      # step 1 skipped: no update
    assert not np.array_equal(v_before[3], v_before[2])  # step 2 entered v
    assert all(np.array_equal(v_before[s], v_before[3]) for s in (4, 5, 6))  # frozen from step 3


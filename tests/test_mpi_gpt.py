"""The GPT with everything around it, inside one MPI job (run under mpirun -n 1..4).

N ranks train like one rank with the N-times batch under every all-reduce strategy (several
buckets, overlap on) and with gradient accumulation; compression keeps ranks identical; a
checkpoint resumes bit-exactly and at other world sizes; the rollback guard recovers a step
whose parameters went bad on one rank. Every rank runs the 1-rank reference itself on
COMM_SELF. float64 with rtol 1e-10: the runs differ only in the order per-token gradients are
summed (within a rank, then across ranks).
"""

import numpy as np
import pytest

from hpctrain.training.config import Config
from steps import train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

B = 24  # global batch in windows: divisible by 1, 2, 3 and 4 ranks, and by 2 micro-batches per rank


def _config(text, steps=6, dtype="float64", allreduce="mpi", ckpt_dir="/tmp/hpctrain-unused", resume="",
            **train):
    cfg = Config()
    cfg.model.kind = "gpt"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 2, 16, 16
    cfg.data.train = text
    cfg.train.global_batch, cfg.train.steps, cfg.train.dtype = B, steps, dtype
    cfg.train.log_every, cfg.train.device, cfg.train.eval_tokens = 10**6, "cpu", 256
    for key, value in train.items():
        setattr(cfg.train, key, value)
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay = "adamw", 3e-3, 2, 0.1
    # small buckets: the GPT's ~9 K parameters (72 KB in float64) reduce in several pieces, overlapped
    cfg.dist.allreduce, cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = allreduce, 0.02, 0.01
    cfg.dist.auto_cache = ""
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = ckpt_dir, resume, 0
    cfg.checkpoint.every_minutes = 0
    return cfg.validate()


def _trainer(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    return Trainer(cfg, world, Log(False))


def _train(cfg, world):
    trainer = _trainer(cfg, world)
    trainer.run()
    data = trainer.model.flat.data.copy()
    if hasattr(trainer.plan.allreduce, "close"):
        trainer.plan.allreduce.close()  # shm windows are freed collectively (the pytest ranks run on)
    return data, trainer


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.fixture(scope="module")
def reference(mpi_text_data):
    """Parameters after 6 steps on one rank with the whole global batch."""
    from mpi4py import MPI

    from hpctrain.runtime import init_world

    params, trainer = _train(_config(mpi_text_data), init_world(MPI.COMM_SELF))
    assert len(trainer.plan.buckets) >= 3  # the test is about several buckets
    return params


@pytest.mark.parametrize("allreduce", ["mpi", "naive", "ring", "rhd", "hierarchical", "shm", "auto"])
def test_n_ranks_equal_one_rank_with_n_times_batch(world, mpi_text_data, reference, allreduce):
    if world.size == 1 and allreduce in ("mpi", "ring", "rhd", "shm"):
        # at one rank these leave the gradient as it is: the run is the reference's own
        pytest.skip("one rank: this strategy leaves the gradient as it is (the run is the reference's)")
    params, _ = _train(_config(mpi_text_data, allreduce=allreduce), world)
    np.testing.assert_allclose(params, reference, rtol=1e-10, atol=1e-13)


def test_grad_accumulation_equals_the_whole_batch(world, mpi_text_data, reference):
    params, _ = _train(_config(mpi_text_data, grad_accum_steps=2), world)
    np.testing.assert_allclose(params, reference, rtol=1e-10, atol=1e-13)


def test_training_moves_the_weights_and_lowers_the_loss(world, mpi_text_data, reference):
    from hpctrain.device import CpuDevice
    from hpctrain.models.gpt import GPT

    fresh = GPT(CpuDevice("float64"), 256, 16, 2, 2, 16)
    fresh.init(0)
    assert np.abs(reference - fresh.flat.data).max() > 1e-3  # the equivalence checks are not vacuous
    cfg = _config(mpi_text_data, steps=40)
    cfg.optim.lr = 0.01
    trainer = _trainer(cfg, world)
    before = trainer.evaluate()["bpb"]
    trainer.run()
    after = trainer.evaluate()
    assert before > 7.5 and after["bpb"] < 5.0, (before, after)  # 8 bits (uniform) at the start
    state = [trainer.model.flat.data.copy(), trainer.model.flat.grad.copy(),
             *(v.copy() for v in trainer.optimizer.state().values())]
    assert after == trainer.evaluate()  # evaluation changes nothing it reads ...
    trainer.evaluate(whole=True)
    for saved, now in zip(state, [trainer.model.flat.data, trainer.model.flat.grad,  # ... or anything else
                                  *trainer.optimizer.state().values()]):
        assert np.array_equal(saved, now)


@pytest.mark.compares_ranks
@pytest.mark.parametrize("whole", [False, True])
def test_evaluation_shards_add_up_to_one_rank(world, mpi_text_data, whole):
    """Each rank scores its shard of the validation windows (uneven at 3 ranks); the all-reduced
    scores equal one rank scoring them all (accuracy exactly, the loss up to summation order)."""
    from mpi4py import MPI

    from hpctrain.runtime import init_world

    n = _trainer(_config(mpi_text_data, steps=0), world).evaluate(whole)
    one = _trainer(_config(mpi_text_data, steps=0), init_world(MPI.COMM_SELF)).evaluate(whole)
    assert n["accuracy"] == one["accuracy"] and n["bpb"] == pytest.approx(one["bpb"], rel=1e-12)


@pytest.mark.compares_ranks
@pytest.mark.parametrize("compress", ["fp16", "topk(0.05)", "powersgd(2)"])
def test_compression_keeps_every_rank_identical(world, mpi_text_data, compress):
    cfg = _config(mpi_text_data, steps=5, dtype="float32")
    cfg.dist.compress = compress
    params, trainer = _train(cfg, world)
    root = world.comm.bcast(params if world.rank == 0 else None, root=0)
    assert np.array_equal(params, root) and np.all(np.isfinite(params))
    assert trainer.compression.sent_bytes > 0 or world.size == 1  # one rank has nothing to send


def _fresh_dir(world, tag):
    from conftest import fresh_shared_dir

    return fresh_shared_dir(world, f"gpt-{tag}")


def test_resume_is_bit_exact(world, mpi_text_data):
    """10 steps in one go == 4 steps, save, a new trainer resumes and runs to 10: identical bytes."""
    straight, _ = _train(_config(mpi_text_data, steps=10, dtype="float32"), world)
    d = _fresh_dir(world, "exact")
    first = _trainer(_config(mpi_text_data, steps=10, dtype="float32", ckpt_dir=d), world)
    for _ in range(4):
        train_step(first)
    first.checkpoints.save(first.state)
    resumed = _trainer(_config(mpi_text_data, steps=10, dtype="float32", ckpt_dir=d, resume="auto"), world)
    assert resumed.step == 4
    resumed.run()
    assert resumed.model.flat.data.tobytes() == straight.tobytes()
    assert first.model.flat.data.tobytes() != straight.tobytes()


@pytest.mark.compares_ranks
def test_resume_at_another_world_size(world, mpi_text_data):
    """Saved by every rank, resumed by 1 .. n-1 of them: the same run continues (float64)."""
    from mpi4py import MPI

    from hpctrain.runtime import init_world

    expected, _ = _train(_config(mpi_text_data, steps=8), world)
    d = _fresh_dir(world, "reshard")
    saver = _trainer(_config(mpi_text_data, steps=8, ckpt_dir=d), world)
    for _ in range(3):
        train_step(saver)
    saver.checkpoints.save(saver.state)
    for m in range(1, world.size):
        sub = world.comm.Split(0 if world.rank < m else MPI.UNDEFINED, key=world.rank)
        if sub != MPI.COMM_NULL:
            t = _trainer(_config(mpi_text_data, steps=8, ckpt_dir=d, resume="auto"), init_world(sub))
            assert t.step == 3
            t.run()
            np.testing.assert_allclose(t.model.flat.data, expected, rtol=1e-9, atol=1e-12)
            sub.Free()
        world.comm.Barrier()


def test_rollback_recovers_parameters_gone_bad_on_one_rank(world, mpi_text_data):
    """A NaN written into the last rank's weights before step 5: every rank judges the step bad,
    reloads the newest checkpoint (step 4), steps over that batch and finishes with finite,
    identical parameters."""
    d = _fresh_dir(world, "rollback")
    cfg = _config(mpi_text_data, steps=8, dtype="float32", ckpt_dir=d)
    cfg.guard.nonfinite, cfg.checkpoint.every_steps = "rollback", 2
    trainer = _trainer(cfg, world)
    compute_step = trainer.stepper.run
    poisoned = []

    def poison_once(at, x, y, votes=None):
        if trainer.step == 5 and not poisoned and world.rank == world.size - 1:
            trainer.model.flat.data[7] = np.nan
            poisoned.append(True)
        return compute_step(at, x, y, votes)
    trainer.stepper.run = poison_once
    result = trainer.run()
    assert result["bad_steps"] == 1 and trainer.step == 8
    params = trainer.model.flat.data
    root = world.comm.bcast(params if world.rank == 0 else None, root=0)
    assert np.all(np.isfinite(params)) and np.array_equal(params, root)

"""ZeRO-1 (``dist.zero = 1``) against zero 0, inside one MPI job (run under mpirun -n 1..4).

Both runs train here, on this job's ranks, in float64 with several buckets and two micro-batches
per rank. ring and naive give the same bits: ring's reduce-scatter is its all-reduce's first half
(the same additions in the same order), and naive's is its whole all-reduce. mpi's
MPI_Reduce_scatter may add ranks in another order than its MPI_Allreduce, so there the runs agree
to rtol 1e-10 (rounding of the 1e-16 kind per step, as the N-rank equivalence tests allow).
"""

import os

import numpy as np
import pytest

from hpctrain.config import Config

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _config(model, data, optim, allreduce, zero, steps=6, ckpt_dir="/tmp/hpctrain-unused", resume=""):
    cfg = Config()
    if model == "gpt":
        cfg.model.kind = "gpt"
        cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 2, 16, 16
        cfg.data.train, cfg.train.eval_tokens = data, 256
        cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.02, 0.01  # ~9 K parameters: several buckets
    else:
        cfg.data.train, cfg.data.eval = data[0], ""
        cfg.model.hidden = [16, 12]
        cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.001, 0.0003  # 400 parameters: three buckets
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = 24, 2, steps
    cfg.train.dtype, cfg.train.log_every = "float64", 10**6
    cfg.optim.name, cfg.optim.warmup_steps, cfg.optim.weight_decay = optim, 2, 0.1
    cfg.optim.lr = 0.05 if optim == "sgd" else 3e-3
    cfg.dist.allreduce, cfg.dist.zero = allreduce, zero
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = ckpt_dir, resume, 0
    cfg.checkpoint.every_minutes, cfg.checkpoint.save_final = 0, True
    return cfg.validate()


def _train(cfg, world):
    from hpctrain.log import Log
    from hpctrain.train import Trainer

    trainer = Trainer(cfg, world, Log(False))
    initial = trainer.model.flat.data.copy()
    trainer.run()
    return trainer, initial


def _whole_state(trainer):
    """The optimizer's state as whole flat arrays (gathered under zero 1)."""
    opt = trainer.optimizer
    if opt.shards is None:
        return {k: np.array(v) for k, v in opt.state().items()}
    return {k: opt.shards.gather(trainer.world.comm, np.asarray(v), trainer.model.flat.size)
            for k, v in opt.state().items()}


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.fixture
def data(request, mpi_small_data, mpi_text_data):
    return mpi_text_data if request.param == "gpt" else mpi_small_data


CASES = [("mlp", "sgd", "ring"), ("mlp", "sgd", "naive"), ("mlp", "sgd", "mpi"), ("mlp", "adamw", "ring"),
         ("mlp", "adamw", "mpi"), ("gpt", "adamw", "ring"), ("gpt", "adamw", "mpi"), ("gpt", "sgd", "naive")]


@pytest.mark.parametrize("data, optim, allreduce", CASES, indirect=["data"], ids=["-".join(c) for c in CASES])
def test_zero_1_trains_like_zero_0(world, data, optim, allreduce):
    model = "gpt" if isinstance(data, str) else "mlp"
    zero0, initial = _train(_config(model, data, optim, allreduce, 0), world)
    zero1, _ = _train(_config(model, data, optim, allreduce, 1), world)
    assert len(zero1.buckets) >= 3  # the test is about several buckets, each cut in shares
    p0, p1 = zero0.model.flat.data, zero1.model.flat.data
    s0, s1 = _whole_state(zero0), _whole_state(zero1)
    if allreduce in ("ring", "naive"):
        assert np.array_equal(p0, p1)
        assert all(np.array_equal(s0[k], s1[k]) for k in s0)
    else:
        np.testing.assert_allclose(p1, p0, rtol=1e-10, atol=1e-13)
        for k in s0:
            np.testing.assert_allclose(s1[k], s0[k], rtol=1e-10, atol=1e-13)
    assert np.abs(p1 - initial).max() > 1e-3  # training moved the weights
    # every rank holds the same parameters after the all-gathers
    assert np.array_equal(p1, world.comm.bcast(p1 if world.rank == 0 else None, root=0))


@pytest.mark.parametrize("allreduce", ["ring", "mpi"])
def test_each_rank_keeps_its_share_of_the_optimizer_state(world, mpi_text_data, allreduce):
    trainer, _ = _train(_config("gpt", mpi_text_data, "adamw", allreduce, 1, steps=1), world)
    opt, flat, size = trainer.optimizer, trainer.model.flat, world.size
    # the allocated arrays are the share: exp_avg and exp_avg_sq hold state_size elements each
    assert opt.exp_avg.size == opt.exp_avg_sq.size == opt.state_size == opt.shards.owned
    # the shares tile the buffer: together exactly the flat buffer, each within one element a
    # bucket of 1/size of it
    assert sum(world.comm.allgather(opt.state_size)) == flat.size
    bound = sum(-(-b.size // size) for b in trainer.buckets)
    assert flat.size // size - len(trainer.buckets) <= opt.state_size <= bound
    owned = np.zeros(flat.size, np.int64)
    for lo, hi, _ in opt.shards.pieces:
        owned[lo:hi] += 1
    assert np.array_equal(world.comm.allreduce(owned), np.ones(flat.size, np.int64))
    # the start-up line's accounting says so, and matches the allocated arrays
    from hpctrain import memory

    computed = memory.computed(trainer)
    assert computed["optimizer"] == opt.exp_avg.nbytes + opt.exp_avg_sq.nbytes == 2 * 8 * opt.state_size
    assert computed["params"] == computed["grads"] == flat.data.nbytes == 8 * flat.size
    assert "(zero 1: a 1/%d share)" % size in memory.describe(computed, 1, size)


@pytest.mark.parametrize("allreduce", ["ring", "mpi"])
def test_a_zero_1_checkpoint_is_logical_and_resumes_bit_exactly(world, mpi_text_data, mpi_shared_dir, allreduce):
    """Saved at step 3 under zero 1, the file holds what zero 0 saves (ring: the same bits; mpi: to
    rounding), and resuming it under zero 1 to step 6 gives the bits of an uninterrupted run."""
    import h5py

    base = os.path.join(mpi_shared_dir, f"zero-resume-{allreduce}-{world.size}")
    dirs = {z: f"{base}-z{z}" for z in (0, 1)}
    for z, d in dirs.items():
        _train(_config("gpt", mpi_text_data, "adamw", allreduce, z, steps=3, ckpt_dir=d), world)
    world.comm.Barrier()
    with h5py.File(os.path.join(dirs[0], "ckpt-00000003.h5")) as f0, \
            h5py.File(os.path.join(dirs[1], "ckpt-00000003.h5")) as f1:
        names = []
        f0.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert any(n.startswith("optim/exp_avg/") for n in names)
        for n in names:
            if n.startswith(("model/", "optim/")):
                if allreduce == "ring":
                    assert np.array_equal(f0[n][()], f1[n][()]), n
                else:
                    np.testing.assert_allclose(f1[n][()], f0[n][()], rtol=1e-10, atol=1e-13, err_msg=n)
    resumed, _ = _train(_config("gpt", mpi_text_data, "adamw", allreduce, 1, steps=6, ckpt_dir=dirs[1],
                                resume="auto"), world)
    assert resumed.checkpoints.saved_path is not None
    straight, _ = _train(_config("gpt", mpi_text_data, "adamw", allreduce, 1, steps=6), world)
    assert np.array_equal(resumed.model.flat.data, straight.model.flat.data)
    s0, s1 = _whole_state(resumed), _whole_state(straight)
    assert all(np.array_equal(s0[k], s1[k]) for k in s0)

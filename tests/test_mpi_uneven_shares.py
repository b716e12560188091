"""Uneven shares: a world size that does not divide the global batch (run under mpirun -n 1..4).

Ranks take contiguous shares of each global batch that differ by at most one row, and every
loss is weighted by 1 / (the whole batch's predictions), so N ranks still train like one rank
with the whole batch: the MLP with every all-reduce strategy at global batch 256 (uneven at 3
ranks) or 255 (uneven at 2 and 4), gradient accumulation whose micro-batches differ by one row
(254 rows in 3), and the GPT at 25 windows (uneven at 2, 3 and 4). Every rank runs the 1-rank
reference itself on COMM_SELF. float64, rtol 1e-10: the runs differ only in the order per-row gradients are summed.
train.exact_shares keeps the old error.
"""

import numpy as np
import pytest

from hpctrain.training.config import Config
from hpctrain.errors import UserError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _mlp(train, global_batch, allreduce="mpi", **settings):
    cfg = Config()
    cfg.data.train, cfg.data.eval = train, ""
    cfg.model.hidden = [16, 12]
    cfg.train.global_batch, cfg.train.dtype, cfg.train.steps, cfg.train.log_every = global_batch, "float64", 10, 10**6
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay = "adamw", 0.003, 2, 0.01
    cfg.dist.allreduce, cfg.dist.auto_cache = allreduce, ""
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.002, 0.001   # several buckets, overlapped
    for key, value in settings.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg.validate()


def _train(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    trainer = Trainer(cfg, world, Log(False))
    trainer.run()
    params = trainer.model.flat.data.copy()
    if hasattr(trainer.plan.allreduce, "close"):
        trainer.plan.allreduce.close()  # shm windows are freed collectively
    return params, trainer


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.fixture(scope="module")
def one_rank(mpi_small_data):
    """The 1-rank references (one micro-batch), by global batch."""
    from mpi4py import MPI

    from hpctrain.runtime import init_world

    self_world = init_world(MPI.COMM_SELF)
    return {g: _train(_mlp(mpi_small_data[0], g), self_world)[0] for g in (256, 255, 254)}


@pytest.mark.compares_ranks
@pytest.mark.parametrize("allreduce", ["mpi", "naive", "ring", "rhd", "hierarchical", "shm", "auto"])
@pytest.mark.parametrize("global_batch", [256, 255])
def test_uneven_shares_train_like_one_rank(mpi_small_data, world, one_rank, allreduce, global_batch):
    from hpctrain.runtime import init_world

    if global_batch % world.size == 0:
        pytest.skip(f"{global_batch} rows divide evenly at {world.size} rank(s) (the other batch size is uneven)")
    w = init_world(ranks_per_node=2) if allreduce == "hierarchical" else world   # nodes of 2 (+1) ranks
    params, trainer = _train(_mlp(mpi_small_data[0], global_batch, allreduce), w)
    shares = world.comm.allgather(trainer.state.sampler.batch)
    assert sum(shares) == global_batch and max(shares) - min(shares) <= 1
    assert trainer.model.loss.row_weight is not None   # the shares differ: every row weighs 1 / G
    np.testing.assert_allclose(params, one_rank[global_batch], rtol=1e-10, atol=1e-13)


def test_shares_are_contiguous_and_cover_the_batch(mpi_small_data, world):
    _, trainer = _train(_mlp(mpi_small_data[0], 255, train__steps=0), world)
    s = trainer.state.sampler
    rows = world.comm.allgather(s.indices(3))
    whole = np.random.default_rng([s.seed, 0]).permutation(s.n)[3 * 255:4 * 255]
    np.testing.assert_array_equal(np.concatenate(rows), whole)


def test_micro_batches_that_differ_by_one_row_equal_the_whole_batch(mpi_small_data, world, one_rank):
    params, trainer = _train(_mlp(mpi_small_data[0], 254, train__grad_accum_steps=3), world)
    assert trainer.model.loss.row_weight is not None   # 254 / 3 micro-batches is uneven on every rank count
    np.testing.assert_allclose(params, one_rank[254], rtol=1e-10, atol=1e-13)


def test_exact_shares_keep_the_error_that_names_sizes_that_work(mpi_small_data, world):
    g = 256 if world.size == 3 else 255
    if g % world.size == 0:
        pytest.skip("one rank divides every batch")
    with pytest.raises(UserError, match="not divisible by the world size"):
        _train(_mlp(mpi_small_data[0], g, train__exact_shares=True), world)


def test_a_global_batch_smaller_than_the_world_is_one_clear_error(mpi_small_data, world):
    if world.size == 1:
        pytest.skip("one rank always has rows")
    with pytest.raises(UserError, match="smaller than the world size"):
        _train(_mlp(mpi_small_data[0], world.size - 1), world)


@pytest.mark.compares_ranks
def test_the_gpt_with_uneven_shares_trains_like_one_rank(mpi_text_data, world):
    """25 windows of 16 tokens: every token's loss weighs 1 / 400 wherever its window is."""
    from mpi4py import MPI

    from hpctrain.runtime import init_world

    if world.size == 1:
        pytest.skip("25 windows on one rank is the reference itself")

    def cfg():
        c = Config()
        c.model.kind = "gpt"
        c.model.n_layer, c.model.n_head, c.model.d_model, c.model.context = 1, 2, 16, 16
        c.data.train = mpi_text_data
        c.train.global_batch, c.train.steps, c.train.dtype, c.train.device = 25, 5, "float64", "cpu"
        c.train.log_every, c.train.eval_tokens = 10**6, 256
        c.optim.name, c.optim.lr, c.optim.warmup_steps, c.optim.weight_decay = "adamw", 3e-3, 2, 0.1
        c.dist.bucket_mb, c.dist.first_bucket_mb, c.dist.auto_cache = 0.02, 0.01, ""
        c.checkpoint.every_minutes = 0
        return c.validate()

    got, _ = _train(cfg(), world)
    ref, _ = _train(cfg(), init_world(MPI.COMM_SELF))
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-13)

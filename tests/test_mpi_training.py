"""N ranks train like one rank with an N-times batch (run under mpirun -n 1..4).

Every rank also runs the 1-rank reference itself on COMM_SELF, so the check
needs no second launch. float64 with rtol 1e-10: the only difference between
the two runs is the order in which per-sample gradients are summed (within a
rank, then across ranks), which changes results at the 1e-16 level per step.
"""

import numpy as np
import pytest

from hpctrain.training.config import Config

pytestmark = [pytest.mark.mpi, pytest.mark.compares_ranks, pytest.mark.timeout(240)]


def _config(train, per_rank_batch, size, optim, allreduce="mpi", steps=None):
    cfg = Config()
    cfg.data.train, cfg.data.eval = train, ""
    cfg.model.hidden = [16, 12]
    cfg.train.global_batch = per_rank_batch * size
    cfg.train.dtype = "float64"
    # cross an epoch boundary so the per-epoch reshuffle is exercised too
    cfg.train.steps = steps or 2048 // cfg.train.global_batch + 3
    cfg.train.log_every = 10**6
    cfg.optim.name = optim
    cfg.optim.lr = 0.05 if optim == "sgd" else 0.003
    cfg.optim.warmup_steps, cfg.optim.weight_decay, cfg.optim.nesterov = 3, 0.01, True
    cfg.dist.allreduce = allreduce
    return cfg.validate()


def _train(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    trainer = Trainer(cfg, world, Log(False))
    trainer.run()
    return trainer.model.flat.data.copy()


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("allreduce", ["mpi", "naive"])
def test_n_ranks_equal_one_rank_with_n_times_batch(mpi_small_data, optim, allreduce):
    from mpi4py import MPI

    from hpctrain.runtime import init_world

    world = init_world()
    b = 40  # per-rank batch; 2048 samples give 51/25/17/12 steps per epoch at 1/2/3/4 ranks
    params_n = _train(_config(mpi_small_data[0], b, world.size, optim, allreduce), world)
    params_1 = _train(_config(mpi_small_data[0], b * world.size, 1, optim), init_world(MPI.COMM_SELF))
    np.testing.assert_allclose(params_n, params_1, rtol=1e-10, atol=1e-13)
    # and training moved the weights (the check is not vacuous)
    from hpctrain.device import CpuDevice
    from hpctrain.models.mlp import MLP

    fresh = MLP(CpuDevice("float64"), 8, [16, 12], 4)
    fresh.init(0)
    assert np.abs(params_n - fresh.flat.data).max() > 1e-3


def test_ranks_hold_identical_parameters(mpi_small_data):
    """Every rank applies the same averaged gradient, so parameters stay bitwise equal."""
    from hpctrain.runtime import init_world

    world = init_world()
    params = _train(_config(mpi_small_data[0], 16, world.size, "sgd", steps=10), world)
    root = world.comm.bcast(params if world.rank == 0 else None, root=0)
    assert np.array_equal(params, root)


def test_initial_parameters_come_from_rank_0(mpi_small_data):
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    world = init_world()
    cfg = _config(mpi_small_data[0], 16, world.size, "sgd")
    cfg.train.seed = 100 + world.rank  # deliberately different per rank
    trainer = Trainer(cfg, world, Log(False))
    root = world.comm.bcast(trainer.model.flat.data if world.rank == 0 else None, root=0)
    assert np.array_equal(trainer.model.flat.data, root)


def test_eval_accuracy_is_global(mpi_small_data):
    """Each rank scores a shard; the all-reduced accuracy equals a 1-rank evaluation."""
    from mpi4py import MPI

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    world = init_world()
    cfg = _config(mpi_small_data[0], 8, world.size, "sgd", steps=0)
    cfg.data.eval = mpi_small_data[1]
    scores_n = Trainer(cfg, world, Log(False)).evaluate()
    cfg.train.global_batch = 8
    scores_1 = Trainer(cfg, init_world(MPI.COMM_SELF), Log(False)).evaluate()
    assert scores_n["accuracy"] == scores_1["accuracy"]
    assert 0.0 < scores_n["accuracy"] < 1.0
    # the loss is a float sum over shards: the same up to the order of additions
    assert scores_n["loss"] == pytest.approx(scores_1["loss"], rel=1e-6)

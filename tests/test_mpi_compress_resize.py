"""Resuming with compression at another world size (run under mpirun -n 1..4), through real
checkpoints: saved by the n ranks of this job and resumed by each m < n of them (a
sub-communicator), and saved by one rank and resumed by all n, every rank of the resumed run
starts from the mean of the saved ranks' residuals and velocities (PowerSGD's Q: the same on
every rank), so the mean over ranks, what the update still owes, is kept; the run then trains
on. Resumed at another train.grad_accum_steps, residuals and velocities scale with it. The
rules themselves: tests/test_compress_state.py."""

import numpy as np
import pytest

from hpctrain.training.config import Config
from steps import train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

K = 5   # steps before the save


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def _config(train, ckpt_dir, spec, momentum, resume="", accum=1):
    cfg = Config()
    cfg.data.train, cfg.data.eval = train, ""
    cfg.model.hidden = [16, 12]
    cfg.train.global_batch = 24 * 4  # divisible by 1, 2, 3 and 4 ranks
    cfg.train.steps, cfg.train.log_every, cfg.train.metrics = 10, 10**6, ""
    cfg.train.grad_accum_steps = accum
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps = "adamw", 0.003, 2
    cfg.dist.compress, cfg.dist.compress_momentum = spec, momentum
    if momentum:  # its velocities sum through AdamW's second moment, frozen where compression starts
        cfg.optim.freeze_step = cfg.dist.compress_start_step = 2
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.001, 0.001  # several buckets
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = ckpt_dir, resume, 0
    return cfg.validate()


def _trainer(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    return Trainer(cfg, world, Log(False))


def _mean(states):
    """The float64 mean over ranks of each key, rounded once to float32 (the rule's arithmetic)."""
    return {k: (np.sum([np.float64(s[k]) for s in states], axis=0) / len(states)).astype(np.float32)
            for k in states[0]}


def _assert_holds_mean(trainer, want):
    got = trainer.compression.state()
    assert sorted(got) == sorted(want) and want
    for k, v in want.items():
        # float64 sums in another order (each reading rank its rows, then MPI): at most 1 ulp apart
        np.testing.assert_array_max_ulp(np.asarray(got[k], np.float32), v, maxulp=1)


@pytest.mark.parametrize("spec,momentum", [("powersgd(2)", True), ("topk(0.05)", False)])
def test_resume_at_another_world_size_starts_every_rank_from_the_mean_state(world, mpi_small_data, spec, momentum):
    from mpi4py import MPI

    from conftest import fresh_shared_dir
    from hpctrain.runtime import init_world

    data = mpi_small_data[0]
    if world.size > 1:   # saved by all n ranks, resumed by 1 .. n-1 of them
        d = fresh_shared_dir(world, f"resize-down-{spec}")
        saver = _trainer(_config(data, d, spec, momentum), world)
        for _ in range(K):
            train_step(saver)
        saver.checkpoints.save(saver.state)
        states = world.comm.allgather(saver.compression.state())
        assert any(k.startswith("residual/") for k in states[0])
        assert not all(np.array_equal(states[0][k], s[k]) for s in states for k in states[0]), \
            "every rank holds the same state: the mean would prove nothing"
        if momentum:
            assert any(k.startswith("velocity/") for k in states[0])
        want = _mean(states)
        for m in range(1, world.size):
            sub = world.comm.Split(0 if world.rank < m else MPI.UNDEFINED, key=world.rank)
            failure = None
            if sub != MPI.COMM_NULL:
                try:  # a failure here must not leave the ranks outside sub waiting at the barrier
                    t = _trainer(_config(data, d, spec, momentum, resume="auto"), init_world(sub))
                    assert t.step == K
                    _assert_holds_mean(t, want)
                    t.run()
                    assert t.step == 10 and np.isfinite(t.model.flat.data).all()
                except Exception as exc:  # noqa: BLE001 - reported by every rank below
                    failure = f"resumed by {m} rank(s), rank {world.rank}: {exc!r}"
                finally:
                    sub.Free()
            world.comm.Barrier()
            failures = [f for f in world.comm.allgather(failure) if f]
            assert not failures, "\n".join(failures)

    # saved by one rank, resumed by all n with 2 micro-batches a step: every rank starts from that
    # rank's state, its residuals and velocities doubled (sums of 2 micro-batches' gradients now)
    d1 = fresh_shared_dir(world, f"resize-up-{spec}")
    solo_state = None
    if world.rank == 0:
        solo = _trainer(_config(data, d1, spec, momentum), init_world(MPI.COMM_SELF))
        for _ in range(K):
            train_step(solo)
        solo.checkpoints.save(solo.state)
        solo_state = {k: np.array(v, np.float32) for k, v in solo.compression.state().items()}
    solo_state = world.comm.bcast(solo_state)
    t = _trainer(_config(data, d1, spec, momentum, resume="auto", accum=2), world)
    assert t.step == K
    _assert_holds_mean(t, {k: v if k.startswith("q/") else v * 2 for k, v in solo_state.items()})
    t.run()
    assert t.step == 10 and np.isfinite(t.model.flat.data).all()

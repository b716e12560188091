"""Buckets, the communication thread, gradient accumulation, strategy choice
and layout agreement, in training (mpirun -n 1..4).

float64 throughout: runs that differ only in summation order agree to ~1e-15
per step, so rtol 1e-10 after a few steps leaves a wide margin while any
real difference (a bucket reduced twice or not at all, a wrong scale) is O(1).
"""

import time

import numpy as np
import pytest

from hpctrain.training.config import Config
from hpctrain.errors import UserError
from steps import train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


# strategies that leave the gradient as it is at one rank (MPI_Allreduce of one rank is a copy; ring,
# rhd and shm return at once): their 1-rank run is the reference's own run
IDLE_AT_ONE_RANK = ("mpi", "ring", "rhd", "shm")


def _config(train, size, **dist):
    cfg = Config()
    cfg.data.train, cfg.data.eval = train, ""
    cfg.model.hidden = [32, 24, 16]
    cfg.train.global_batch, cfg.train.dtype, cfg.train.steps, cfg.train.log_every = 8 * size, "float64", 6, 10**6
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps = "adamw", 0.003, 2
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.002, 0.001   # a few KB: one bucket per layer or so
    cfg.dist.auto_cache = ""
    for key, value in dist.items():
        section, name = key.split("__") if "__" in key else ("dist", key)
        setattr(getattr(cfg, section), name, value)
    return cfg.validate()


def _train(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    trainer = Trainer(cfg, world, Log(False))
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def test_buckets_cover_the_gradient_in_reverse_layer_order(mpi_small_data, world):
    trainer = _train(_config(mpi_small_data[0], world.size, train__steps=0), world)
    buckets, flat = trainer.plan.buckets, trainer.model.flat
    assert len(buckets) > 2
    assert buckets[0].slots[0] == flat.slots[-1].name          # last layer first
    assert buckets[0].hi == flat.size and buckets[-1].lo == 0   # contiguous, complete, no overlap
    assert all(a.lo == b.hi for a, b in zip(buckets, buckets[1:]))


@pytest.mark.parametrize("allreduce", ["mpi", "naive", "ring", "rhd", "hierarchical", "shm", "auto"])
def test_every_strategy_trains_like_mpi(mpi_small_data, world, allreduce):
    from hpctrain.runtime import init_world

    if world.size == 1 and allreduce in IDLE_AT_ONE_RANK:
        pytest.skip("one rank: this strategy leaves the gradient as it is (the run is the reference's)")
    # hierarchical on simulated nodes of 2 ranks (2 + 1 at 3 ranks)
    w = init_world(ranks_per_node=2) if allreduce == "hierarchical" else world
    ref = _train(_config(mpi_small_data[0], world.size), world).model.flat.data
    got = _train(_config(mpi_small_data[0], world.size, allreduce=allreduce), w).model.flat.data
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-13)


def test_overlap_off_gives_the_same_bytes(mpi_small_data, world):
    on = _train(_config(mpi_small_data[0], world.size), world).model.flat.data
    off = _train(_config(mpi_small_data[0], world.size, overlap=False), world).model.flat.data
    assert np.array_equal(on, off)   # same strategy, same buckets, same order: bitwise


def test_gradient_accumulation_equals_the_large_batch(mpi_small_data, world):
    big = _train(_config(mpi_small_data[0], world.size), world).model.flat.data
    accum = _train(_config(mpi_small_data[0], world.size, train__grad_accum_steps=4), world).model.flat.data
    np.testing.assert_allclose(accum, big, rtol=1e-10, atol=1e-13)


def test_grad_accum_that_does_not_divide_the_batch_is_an_error_with_exact_shares(mpi_small_data, world):
    with pytest.raises(UserError, match="grad_accum_steps=3 does not divide the per-rank batch 8"):
        _train(_config(mpi_small_data[0], world.size, train__grad_accum_steps=3, train__exact_shares=True), world)


@pytest.mark.parametrize("allreduce", ["shm", "mpi"])
def test_a_nan_in_one_ranks_gradient_skips_the_step_on_every_rank(mpi_small_data, world, allreduce):
    """The loss stays finite; the last rank's gradient gets a NaN after backward, in the last
    layer's bias (folded by the last rank in shm's window) or in the first layer's weights
    (folded by rank 0): every rank judges the step bad and skips it, the parameters stay
    finite and equal everywhere. With shm each rank tests only its share of the averaged
    gradient, so this holds only if the step statistics combine the ranks' answers."""
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    for where in ("last", "first"):
        cfg = _config(mpi_small_data[0], world.size, allreduce=allreduce, overlap=False,
                      guard__nonfinite="skip", guard__check_grads=True)
        trainer = Trainer(cfg, world, Log(False))
        backward = trainer.model.backward
        index = trainer.model.flat.size - 1 if where == "last" else 0

        def poisoned(*args, **kw):
            backward(*args, **kw)
            if trainer.step == 3 and world.rank == world.size - 1:
                trainer.model.flat.grad[index] = np.nan
        trainer.model.backward = poisoned
        result = trainer.run()
        params = trainer.model.flat.data
        # gathered before any assert: a rank failing alone would leave the others in the allgather
        seen = world.comm.allgather((result["bad_steps"], bool(np.isfinite(params).all()), params.tobytes()))
        assert [s[:2] for s in seen] == [(1, True)] * world.size, (where, [s[:2] for s in seen])
        assert len({s[2] for s in seen}) == 1
        if hasattr(trainer.plan.allreduce, "close"):
            trainer.plan.allreduce.close()   # collective; the pytest-mpi ranks live on for other tests


def test_bucket_layout_mismatch_is_a_clear_error_not_a_hang(mpi_small_data, world):
    if world.size < 2:
        pytest.skip("a mismatch needs two ranks")
    # rank 1 builds other buckets: without the check its collectives would pair wrongly
    cfg = _config(mpi_small_data[0], world.size, bucket_mb=0.002 if world.rank != 1 else 25.0)
    with pytest.raises(UserError, match="ranks disagree on the gradient bucket layout"):
        _train(cfg, world)


def test_buckets_are_reduced_on_the_thread_while_backward_still_runs(mpi_small_data, world, monkeypatch):
    """With dist.overlap, every bucket but the last (the first layer's, ready only when backward ends)
    is all-reduced on the communication thread, the first of them starting while this rank's backward
    has not ended; without it, every bucket is all-reduced on the main thread after backward.
    A structural check of the overlap: the order of events and their threads, not a ratio of times.
    (Each layer's backward sleeps 100 ms, so the thread has three layers' 300 ms to pick the first
    ready bucket up; a later bucket may wait for slower ranks in the collective before it, so only the
    thread is checked for those.) How much of the communication a step hides is a benchmark's to measure
    (benchmarks/scaling.py)."""
    import threading

    if world.size < 2:
        pytest.skip("a 1-rank all-reduce does no communication to overlap")
    from hpctrain.comm.buckets import BucketedAllreduce
    from hpctrain.nn.layers import Linear
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    events = []   # ("backward", end) and ("reduce", bucket, start, on the main thread?)
    slow, reduce = Linear.backward, BucketedAllreduce._reduce

    def backward(self, dout, accumulate=False):
        time.sleep(0.1)
        out = slow(self, dout, accumulate)
        events.append(("backward", time.perf_counter()))
        return out

    def recorded(self, i):
        events.append(("reduce", i, time.perf_counter(), threading.current_thread() is threading.main_thread()))
        return reduce(self, i)

    monkeypatch.setattr(Linear, "backward", backward)
    monkeypatch.setattr(BucketedAllreduce, "_reduce", recorded)
    steps = {}   # overlap -> per step: (backward ends, {bucket: (start, on main)}); checked after the runs
    for overlap in (True, False):
        cfg = _config(mpi_small_data[0], world.size, overlap=overlap, train__steps=2)
        trainer = Trainer(cfg, world, Log(False))
        n = len(trainer.plan.buckets)
        steps[overlap] = []
        for _ in range(2):
            events.clear()
            train_step(trainer)
            steps[overlap].append(([e[1] for e in events if e[0] == "backward"],
                                   {e[1]: e[2:] for e in events if e[0] == "reduce"}))
        trainer.close(0)
    assert n >= 3
    for overlap, recorded_steps in steps.items():
        for ends, reduced in recorded_steps:
            assert len(ends) == len(cfg.model.hidden) + 1 and sorted(reduced) == list(range(n))  # each bucket once
            if overlap:
                assert not any(reduced[i][1] for i in range(n - 1)), reduced   # on the thread
                assert reduced[0][0] < ends[-1], (reduced[0][0] - ends[-1])   # while backward still runs
            else:
                assert all(on_main and start >= ends[-1] for start, on_main in reduced.values()), reduced


def test_auto_picks_the_same_strategy_on_every_rank_and_caches_its_fit(mpi_shared_dir, world):
    from hpctrain.device import CpuDevice
    from hpctrain.comm import make_allreduce

    path = f"{mpi_shared_dir}/auto-fit.json"
    first = make_allreduce("auto", world, CpuDevice("float64"), cache_path=path)
    again = make_allreduce("auto", world, CpuDevice("float64"), cache_path=path)
    assert again.fits == first.fits                       # read back from the cache, not re-measured
    picks = [first.choose(n) for n in (1 << 10, 1 << 16, 1 << 22, 1 << 26)]
    assert len({tuple(p) for p in world.comm.allgather(picks)}) == 1
    buf = world.rank + np.arange(1000.0)
    first(buf, "sum")
    np.testing.assert_array_equal(buf, world.size * np.arange(1000.0) + world.size * (world.size - 1) / 2)


def test_auto_on_one_machine_offers_shm_zero_copy_and_the_trainer_uses_it(mpi_small_data, world):
    from hpctrain.device import CpuDevice
    from hpctrain.comm import make_allreduce

    strategy = make_allreduce("auto", world, CpuDevice("float64"))
    assert "shm" in strategy.names and "shm zero-copy" in strategy.names
    window = strategy.allocate(3000, "float64")
    for lo, hi in ((0, 3000), (100, 1123)):     # a slice of the window and a plain array, every rank alike
        for buf in (window[lo:hi], np.zeros(hi - lo)):
            buf[:] = world.rank + np.arange(hi - lo)
            strategy(buf, "sum")
            np.testing.assert_array_equal(buf, world.size * np.arange(hi - lo) + world.size * (world.size - 1) / 2)
    if world.size > 1:
        assert strategy._picked and {zc for _, zc in strategy._picked} == {False, True}
    strategy.strategies["shm"].close()   # collective; the pytest-mpi ranks live on for other tests
    trainer = _train(_config(mpi_small_data[0], world.size, allreduce="auto"), world)
    assert trainer.plan.allreduce._shm.holds(trainer.model.flat.grad)   # the gradients live in the window
    trainer.plan.allreduce._shm.close()


def _favouring(winner: str, names) -> dict:
    """auto fits under which ``winner`` is predicted fastest at every size (the others cost 1 s)."""
    from hpctrain.comm.auto import PROBE_BYTES

    return {n: [(0.0 if n == winner else 1.0, 1e-15)] * (len(PROBE_BYTES) - 1) for n in names}


def test_a_resume_takes_the_auto_choices_its_checkpoint_was_made_with(mpi_small_data, world, monkeypatch):
    """dist.allreduce = auto, its fits cached in a file that other jobs share: a run picks ring
    (its fits say so), saves at step 4, and runs to step 10; then another job writes the same layout's
    entry with fits that pick rhd. Resumed from step 4, the run takes its checkpoint's choices
    (ring), not the cache's, and ends on the bits of the run that never stopped (at 3 and 4 ranks
    ring and rhd add in different orders, so the cache's choice would end elsewhere)."""
    import os

    from conftest import fresh_shared_dir

    from hpctrain.comm import auto

    d = fresh_shared_dir(world, "auto-resume")
    cache = os.path.join(d, "auto.json")
    monkeypatch.setattr(auto.AutoAllreduce, "_measure",
                        lambda self: _favouring("ring", self.names) if self.world.rank == 0 else None)

    def run(**settings):
        cfg = _config(mpi_small_data[0], world.size, allreduce="auto", auto_cache=cache,
                      checkpoint__dir=d, checkpoint__every_steps=4, checkpoint__every_minutes=0.0, **settings)
        cfg.train.steps = 10
        trainer = _train(cfg, world)
        if trainer.plan.allreduce._shm is not None:
            trainer.plan.allreduce._shm.close()  # collective; the pytest-mpi ranks live on
        return trainer

    straight = run()
    picked = straight.plan.allreduce.choose(1 << 12, True)
    assert picked == "ring"
    if world.rank == 0:  # another job, the same layout: its measurement now favours rhd
        auto._save(cache, straight.plan.allreduce.key, _favouring("rhd", straight.plan.allreduce.names))
    world.comm.Barrier()
    resumed = run(checkpoint__resume=os.path.join(d, "ckpt-00000004.h5"))
    assert resumed.step == 10 and resumed.plan.allreduce.choose(1 << 12, True) == "ring"
    assert np.array_equal(resumed.model.flat.data, straight.model.flat.data)
    # and a fresh run at this layout reads the cache's (rhd) entry: the cache was not the reason
    cfg = _config(mpi_small_data[0], world.size, allreduce="auto", auto_cache=cache, checkpoint__dir=d + "/fresh")
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    fresh = Trainer(cfg, world, Log(False))
    assert fresh.plan.allreduce.choose(1 << 12, True) == "rhd"
    if fresh.plan.allreduce._shm is not None:
        fresh.plan.allreduce._shm.close()
    fresh.close()

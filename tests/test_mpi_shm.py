"""The shm strategy's zero-copy path: buffers in its shared window (run under mpirun -n 1..4).

The copy path (plain buffers) runs the common battery in test_mpi_strategies.py.
"""

import numpy as np
import pytest

from hpctrain.device import CpuDevice

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def shm(world, dtype="float32", **kw):
    from hpctrain.comm.shm import ShmAllreduce

    return ShmAllreduce(world, CpuDevice(dtype), **kw)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_slices_of_the_window_reduce_in_place_like_the_closed_form(world, dtype):
    """Bucket-like slices at several offsets (empty and shorter-than-size ones too): each
    reduced in place, nothing outside it touched, the same bytes on every rank."""
    allreduce = shm(world, dtype)
    n = 5000
    grad = allreduce.allocate(n, dtype)
    assert grad.shape == (n,) and grad.dtype == dtype and not grad.any()
    size, rank = world.size, world.rank
    for lo, hi in [(0, n), (4000, 5000), (17, 20), (100, 100), (1, 4001)]:
        for op in ("sum", "mean", "max", "min"):
            grad[:] = -7.0
            i = np.arange(lo, hi, dtype=np.float64)
            grad[lo:hi] = rank + i
            view = grad[lo:hi]
            assert allreduce(view, op) is view
            expected = {"sum": size * i + size * (size - 1) / 2, "mean": i + (size - 1) / 2,
                        "max": size - 1 + i, "min": i}[op]
            np.testing.assert_allclose(grad[lo:hi], expected, rtol=2 * np.finfo(dtype).eps, err_msg=op)
            assert np.all(grad[:lo] == -7.0) and np.all(grad[hi:] == -7.0), "outside the slice changed"
            digests = world.comm.allgather(grad.tobytes())
            assert all(d == digests[0] for d in digests)


def test_zero_copy_equals_the_copy_path_bitwise(world):
    """The same random data through the window and through a plain buffer: identical bytes
    (one algorithm, one summation order), 2^20 + 3 elements across several segments."""
    allreduce = shm(world, segment_bytes=1 << 18)
    n = 2**20 + 3
    x = np.random.default_rng(50 + world.rank).standard_normal(n).astype(np.float32)
    window = allreduce.allocate(n, np.float32)
    window[:] = x
    plain = x.copy()
    allreduce(window, "sum")
    allreduce(plain, "sum")
    np.testing.assert_array_equal(window, plain)


def test_reduce_scatter_in_the_window_leaves_each_rank_its_chunk_of_the_sum_bitwise(world):
    """ZeRO's reduce-scatter in the window: chunk ``rank`` (the ring's cut) of this rank's slice holds
    the bits of the whole sum's (the same fold, in the same rank order); outside the slice nothing
    changes. Slices shorter than the world too."""
    from hpctrain.comm.ring import chunk_offsets

    allreduce = shm(world, "float64")
    n = 3001
    grad = allreduce.allocate(n, "float64")
    rng = np.random.default_rng(7 + world.rank)
    for lo, hi in [(0, n), (10, 2010), (5, 7)]:
        grad[:] = -3.0
        x = rng.standard_normal(hi - lo)
        grad[lo:hi] = x
        whole = x.copy()
        allreduce(whole, "sum")
        view = grad[lo:hi]
        assert allreduce.reduce_scatter(view) is view
        off = chunk_offsets(hi - lo, world.size)
        mine = slice(off[world.rank], off[world.rank + 1])
        np.testing.assert_array_equal(view[mine], whole[mine])
        assert np.all(grad[:lo] == -3.0) and np.all(grad[hi:] == -3.0), "outside the slice changed"


def test_ranks_passing_different_buffers_get_one_error_not_a_hang(world):
    """Rank 0 passes a window slice, the others a plain buffer (or another offset): every
    rank raises the same ValueError (the test's timeout is the hang detector)."""
    if world.size == 1:
        pytest.skip("needs 2+ ranks: one rank cannot disagree with itself")
    allreduce = shm(world)
    grad = allreduce.allocate(64, np.float32)
    plain = np.ones(16, np.float32)
    with pytest.raises(ValueError, match="different buffers"):
        allreduce(grad[:16] if world.rank == 0 else plain, "sum")
    with pytest.raises(ValueError, match="different buffers"):
        allreduce(grad[:16] if world.rank == 0 else grad[16:32], "sum")
    # both kinds still work afterwards
    grad[:8] = 1
    allreduce(grad[:8], "sum")
    assert np.all(grad[:8] == world.size)
    allreduce(plain, "sum")
    assert np.all(plain == world.size)


def test_trainer_keeps_its_gradients_in_the_window(mpi_small_data, world):
    """dist.allreduce = 'shm' on CPU: the flat gradient is the window slot, and every layer's
    gradient view points into it (so backward writes where the reduction reads)."""
    from hpctrain.training.config import Config
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    cfg = Config()
    cfg.data.train, cfg.data.eval = mpi_small_data[0], ""
    cfg.model.hidden = [8]
    cfg.train.global_batch, cfg.train.steps, cfg.train.log_every = 8 * world.size, 2, 10**6
    cfg.dist.allreduce, cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = "shm", 0.001, 0.0005
    cfg = cfg.validate()
    trainer = Trainer(cfg, world, Log(False))
    arena = trainer.plan.allreduce.arenas[0]
    assert trainer.model.flat.grad is arena.mine
    for layer in trainer.model.layers:
        assert np.shares_memory(layer.dw, arena.mine) and np.shares_memory(layer.db, arena.mine)
    trainer.run()
    assert np.isfinite(trainer.model.flat.data).all()


def _scale_twin(x, factor):
    """A copy of ``x`` times ``factor``, by the scale kernel's CPU twin."""
    from hpctrain.kernels.scale import scale

    return scale(x.copy(), factor)


def _sum_then_scale(world, x, factor):
    """The reference: MPI_Allreduce's sum of a plain copy, then the scale kernel's twin."""
    from mpi4py import MPI

    ref = x.copy()
    world.comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
    return _scale_twin(ref, factor)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sum_scaled_in_the_window_is_the_sum_then_the_scale_bitwise(world, dtype):
    """The one-pass sum and scale of a window slice gives the bits of a sum followed by
    kernels.scale (the two-pass averaging it replaces), for factors that are exact in binary
    (1/2, 1/4) and others (1/3, 0.37), over several tiles and at unaligned offsets; ``mean``
    in the window is sum_scaled by 1/size. At 2 ranks a sum of two float32 values is
    exact-rounded whatever the order, so MPI_Allreduce is a bitwise reference; at more ranks
    the fold's row order is the one reference (the plain-buffer path folds the same way)."""
    allreduce = shm(world, dtype)
    n = 3 * 2048 + 77   # past one tile, not a whole number of them
    grad = allreduce.allocate(n, dtype)
    rng = np.random.default_rng(7 + world.rank)
    for lo, hi in [(0, n), (5, n - 3), (1000, 1001), (0, 0)]:
        for factor in (1.0, 0.5, 0.25, 1 / 3, 0.37, 1.0 / world.size):
            x = rng.standard_normal(hi - lo).astype(dtype)
            grad[:] = -7.0
            grad[lo:hi] = x
            plain = x.copy()
            assert allreduce.sum_scaled(grad[lo:hi], factor, check_finite=True) is True
            allreduce(plain, "sum")                   # the copy path: the same fold
            np.testing.assert_array_equal(grad[lo:hi], _scale_twin(plain, factor), err_msg=f"{factor}")
            if world.size <= 2:
                np.testing.assert_array_equal(grad[lo:hi], _sum_then_scale(world, x, factor))
            assert np.all(grad[:lo] == -7.0) and np.all(grad[hi:] == -7.0), "outside the slice changed"
            assert len(set(world.comm.allgather(grad.tobytes()))) == 1
        x = rng.standard_normal(hi - lo).astype(dtype)
        grad[lo:hi], plain = x, x.copy()
        allreduce(grad[lo:hi], "mean")
        allreduce(plain, "mean")                       # copy path: sum, then the scale kernel
        np.testing.assert_array_equal(grad[lo:hi], plain)


@pytest.mark.parametrize("name", ["shm", "auto", "mpi"])
def test_sum_scaled_finiteness_answers_together_cover_the_buffer(world, name):
    """One NaN, +Inf or -Inf on one rank, at the ends, inside and at a tile edge of the buffer,
    or finite inputs whose sum overflows: some rank answers False, on every strategy (shm and
    auto in the window test only the share they fold, mpi the whole buffer); a clean buffer
    gets True everywhere, and without the check the answer is True even for a bad one."""
    from hpctrain.comm import make_allreduce
    from hpctrain.comm.reduce_ops import sum_scaled

    device = CpuDevice("float32")
    strategy = make_allreduce(name, world, device)
    n = 2 * 2048 + 5
    grad = strategy.allocate(n, "float32") if hasattr(strategy, "allocate") else np.zeros(n, np.float32)
    f = 1.0 / world.size

    def answers(set_bad, check=True):
        grad[:] = 1.0
        set_bad(grad)
        return world.comm.allgather(sum_scaled(strategy, grad, f, device, check))

    assert all(answers(lambda g: None))
    for where in (0, 1, 2047, 2048, n // 2, n - 1):
        for bad in (np.nan, np.inf, -np.inf):
            for culprit in range(world.size):
                def poison(g, where=where, bad=bad, culprit=culprit):
                    if world.rank == culprit:
                        g[where] = bad
                got = answers(poison)
                assert not all(got), (where, bad, culprit, got)
                if name == "mpi":
                    assert not any(got)   # every rank tested the whole buffer
    big = np.float32(3e38)

    def overflow(g):
        g[n - 2] = big                    # finite on every rank; the sum is +Inf
    if world.size > 1:
        assert not all(answers(overflow))
    assert all(answers(lambda g: g.__setitem__(3, np.nan), check=False))
    if hasattr(strategy, "close"):
        strategy.close()
    elif hasattr(strategy, "strategies"):
        strategy.strategies["shm"].close()


def test_auto_forwards_sum_scaled_to_its_pick(world):
    """auto's sum_scaled on a window slice gives shm's one-pass bits when it picks shm
    zero-copy and MPI_Allreduce's sum then the scale when it picks mpi. The pick is forced
    (which one auto measures fastest at a size depends on the machine's timing)."""
    from mpi4py import MPI

    from hpctrain.comm import make_allreduce

    auto = make_allreduce("auto", world, CpuDevice("float32"))
    n = 2 * 2048 + 33
    grad = auto.allocate(n, "float32")
    x = np.random.default_rng(11 + world.rank).standard_normal(n).astype(np.float32)
    for pick in ("shm", "mpi"):
        auto._picked[(grad.nbytes, True)] = auto.strategies[pick]
        grad[:] = x
        assert auto.sum_scaled(grad, 1 / 3, check_finite=True) is True
        plain = x.copy()
        if pick == "shm":
            auto.strategies["shm"](plain, "sum")     # the copy path: the same fold
        else:
            world.comm.Allreduce(MPI.IN_PLACE, plain, op=MPI.SUM)
        np.testing.assert_array_equal(grad, _scale_twin(plain, 1 / 3), err_msg=pick)
    auto.strategies["shm"].close()   # collective; the pytest-mpi ranks live on for other tests

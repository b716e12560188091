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
    from hpctrain.dist.shm import ShmAllreduce

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
            assert allreduce(grad[lo:hi], op) is not None
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
    from hpctrain.config import Config
    from hpctrain.log import Log
    from hpctrain.train import Trainer

    cfg = Config()
    cfg.data.train, cfg.data.eval = mpi_small_data[0], ""
    cfg.model.hidden = [8]
    cfg.train.global_batch, cfg.train.steps, cfg.train.log_every = 8 * world.size, 2, 10**6
    cfg.dist.allreduce, cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = "shm", 0.001, 0.0005
    cfg = cfg.validate()
    trainer = Trainer(cfg, world, Log(False))
    arena = trainer.allreduce.arenas[0]
    assert trainer.model.flat.grad is arena.mine
    for layer in trainer.model.layers:
        assert np.shares_memory(layer.dw, arena.mine) and np.shares_memory(layer.db, arena.mine)
    trainer.run()
    assert np.isfinite(trainer.model.flat.data).all()

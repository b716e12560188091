"""Checkpoints inside one MPI job (run under mpirun -n 1..4): bit-exact resume,
resharding to other world sizes, corrupt-file fallback, serial readability.

Each test trains the small MLP in-process with a Trainer per phase; a
"restart" is a new Trainer on the same communicator (or on a sub-communicator
for a different world size) reading the checkpoint directory.
"""

import os
import signal
import subprocess

import h5py
import numpy as np
import pytest

from hpctrain.training.config import Config
from steps import train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def _config(train, ckpt_dir, size, steps, optim="adamw", dtype="float32", resume=""):
    cfg = Config()
    cfg.data.train, cfg.data.eval = train, ""
    cfg.model.hidden = [16, 12]
    cfg.train.global_batch = 24 * 4  # divisible by 1, 2, 3 and 4 ranks
    cfg.train.dtype = dtype
    cfg.train.steps = steps  # 2048 samples / 96 = 21 steps per epoch: long runs cross epochs
    cfg.train.log_every = 10**6
    cfg.train.metrics = ""
    cfg.optim.name = optim
    cfg.optim.lr = 0.05 if optim == "sgd" else 0.003
    cfg.optim.warmup_steps, cfg.optim.weight_decay = 3, 0.01
    cfg.checkpoint.dir = ckpt_dir
    cfg.checkpoint.resume = resume
    cfg.checkpoint.keep_last = 0
    return cfg.validate()


def _trainer(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    return Trainer(cfg, world, Log(False))


def _steps(trainer, k):
    """Train ``k`` steps of the configured run (its LR schedule spans train.steps)."""
    for _ in range(k):
        train_step(trainer)


def _state_bytes(trainer) -> dict:
    """Parameters and every optimizer state buffer, as bytes, plus the Adam step count."""
    out = {"params": trainer.model.flat.data.tobytes(), "t": getattr(trainer.optimizer, "t", None)}
    out.update({k: v.tobytes() for k, v in trainer.optimizer.state().items()})
    return out


def _fresh_dir(world, tag):
    from conftest import fresh_shared_dir

    from hpctrain.ckpt.format import list_checkpoints

    path = fresh_shared_dir(world, tag)
    assert not list_checkpoints(path)
    return path


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_signal_then_resume_is_bit_exact(world, mpi_small_data, optim):
    """N steps in one go == k steps, SIGUSR1 to rank 0 only, save, resume to N: identical bytes."""
    n_steps, k = 30, 11  # the resumed part crosses the epoch boundary at step 21
    d = _fresh_dir(world, f"exact-{optim}")
    straight = _trainer(_config(mpi_small_data[0], d + "-unused", world.size, n_steps, optim), world)
    straight.run()

    first = _trainer(_config(mpi_small_data[0], d, world.size, n_steps, optim), world)
    compute_step = first.stepper.run

    def step_with_signal(at, x, y, votes=None):
        if first.step == k - 1 and world.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives mid-step, on one rank only
        return compute_step(at, x, y, votes)
    first.stepper.run = step_with_signal
    result = first.run()
    assert result["stopped_by"] is not None and first.step == k  # every rank stopped at the same step

    resumed = _trainer(_config(mpi_small_data[0], d, world.size, n_steps, optim, resume="auto"), world)
    assert resumed.step == k
    resumed.run()
    assert resumed.step == n_steps
    assert _state_bytes(resumed) == _state_bytes(straight)
    # and the first phase really stopped short of the end (the comparison is not vacuous)
    assert _state_bytes(first)["params"] != _state_bytes(straight)["params"]


def test_reshard_to_every_other_world_size(world, mpi_small_data):
    """Save at world size n, resume at every m < n on a sub-communicator (and at n from a 1-rank save):
    the run continues as the unresharded one (float64: the same global batch trains alike at any world size)."""
    from mpi4py import MPI

    from hpctrain.ckpt.state import rng_to_array
    from hpctrain.runtime import init_world

    n_steps, k = 16, 7
    straight = _trainer(_config(mpi_small_data[0], "/tmp/unused", world.size, n_steps, dtype="float64"), world)
    straight.run()
    expected = straight.model.flat.data.copy()

    # saved by every rank of this job, resumed by 1 .. n-1 of them
    d = _fresh_dir(world, "reshard-down")
    saver = _trainer(_config(mpi_small_data[0], d, world.size, n_steps, dtype="float64"), world)
    _steps(saver, k)  # the schedule of an n_steps run, stopped at k
    saver.checkpoints.save(saver.state)
    saved_rng = rng_to_array(saver.state.rng)
    for m in range(1, world.size):
        sub = world.comm.Split(0 if world.rank < m else MPI.UNDEFINED, key=world.rank)
        if sub != MPI.COMM_NULL:
            small = init_world(sub)
            t = _trainer(_config(mpi_small_data[0], d, m, n_steps, dtype="float64", resume="auto"), small)
            assert t.step == k
            np.testing.assert_array_equal(rng_to_array(t.state.rng), saved_rng)  # rank r < m keeps its row
            t.run()
            np.testing.assert_allclose(t.model.flat.data, expected, rtol=1e-9, atol=1e-12)
            sub.Free()
        world.comm.Barrier()

    # saved by one rank, resumed by all n
    d1 = _fresh_dir(world, "reshard-up")
    if world.rank == 0:
        solo = _trainer(_config(mpi_small_data[0], d1, 1, n_steps, dtype="float64"), init_world(MPI.COMM_SELF))
        _steps(solo, k)
        solo.checkpoints.save(solo.state)
    world.comm.Barrier()
    t = _trainer(_config(mpi_small_data[0], d1, world.size, n_steps, dtype="float64", resume="auto"), world)
    assert t.step == k
    if world.rank > 0:  # ranks beyond the saved world start a generator of their own
        from hpctrain.ckpt.state import fresh_rng
        np.testing.assert_array_equal(rng_to_array(t.state.rng), rng_to_array(fresh_rng(0, world.rank, k)))
    t.run()
    np.testing.assert_allclose(t.model.flat.data, expected, rtol=1e-9, atol=1e-12)


def _corrupt(path, how):
    if how == "flip":
        with h5py.File(path, "r") as f:  # a byte inside the largest parameter's data
            d = f["/model/fc1/weight"]
            offset = d.id.get_offset()
        with open(path, "r+b") as fh:
            fh.seek(offset + 5)
            b = fh.read(1)
            fh.seek(offset + 5)
            fh.write(bytes([b[0] ^ 0x40]))
    else:
        size = os.path.getsize(path)
        with open(path, "r+b") as fh:
            fh.truncate(size // 2)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_newest_falls_back_to_previous(world, mpi_small_data, how):
    from hpctrain.ckpt.format import list_checkpoints
    from hpctrain.ckpt.read import CorruptCheckpoint, verify_file
    from hpctrain.errors import UserError
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    d = _fresh_dir(world, f"corrupt-{how}")
    cfg = _config(mpi_small_data[0], d, world.size, 8)
    cfg.checkpoint.every_steps = 4
    _trainer(cfg, world).run()
    (s8, newest), (s4, previous) = list_checkpoints(d)
    assert (s8, s4) == (8, 4)
    if world.rank == 0:
        _corrupt(newest, how)
        with pytest.raises(CorruptCheckpoint):
            verify_file(newest)
        verify_file(previous)
    world.comm.Barrier()

    import io
    out = io.StringIO()
    t = Trainer(_config(mpi_small_data[0], d, world.size, 8, resume="auto"), world, Log(world.rank == 0, out))
    assert t.step == 4
    if world.rank == 0:
        text = out.getvalue()
        assert f"skipping {newest}" in text and "resumed from" in text and previous in text, text

    # naming the corrupt file explicitly is an error on every rank alike, not a fallback
    with pytest.raises(UserError) as err:
        _trainer(_config(mpi_small_data[0], d, world.size, 8, resume=newest), world)
    assert getattr(err.value, "agreed", False) and newest in str(err.value)


def test_file_reads_with_serial_h5py_and_h5dump(world, mpi_small_data):
    from hpctrain.ckpt.format import FORMAT_NAME, crc32_of

    d = _fresh_dir(world, "interop")
    t = _trainer(_config(mpi_small_data[0], d, world.size, 3), world)
    t.run()
    path = t.checkpoints.save(t.state)
    if world.rank == 0:
        with h5py.File(path, "r") as f:
            assert f.attrs["format"] == FORMAT_NAME and f.attrs["step"] == 3
            assert f.attrs["world_size"] == world.size and "[model]" in f.attrs["config"]
            for slot in t.model.flat.slots:
                layer, param = slot.name.split(".")
                stored = f[f"/model/{layer}/{param}"][...]
                np.testing.assert_array_equal(stored, t.model.flat.view(t.model.flat.data, slot.name))
                assert int(f[f"/model/{layer}/{param}"].attrs["crc32"]) == crc32_of(stored)
            assert f["/rng/pcg64"].shape == (world.size, 6)
            assert f["/optim/step_count"][0] == 3
            assert set(f) == {"model", "optim", "compress", "data", "rng"}
        dump = subprocess.run(["h5dump", "-H", path], capture_output=True, text=True, timeout=60)
        assert dump.returncode == 0 and "/model/fc0/weight" not in dump.stderr, dump.stderr
        assert 'DATASET "weight"' in dump.stdout and 'ATTRIBUTE "crc32"' in dump.stdout
    world.comm.Barrier()


@pytest.mark.parametrize("collective", [False, True])
def test_pieces_and_a_failing_rank(world, monkeypatch, collective):
    """Slices written in many small pieces (as >2 GiB slices are) round-trip; a rank whose
    data cannot be produced makes every rank raise one error, without a hang, and commits nothing."""
    from hpctrain.ckpt import slices, write
    from hpctrain.ckpt.read import load_checkpoint, verify_file
    from hpctrain.ckpt.state import Entry

    monkeypatch.setattr(slices, "PIECE_BYTES", 40)  # 2 rows of the (37, 5) float32 array per piece
    rng = np.random.default_rng(7)
    big, small = rng.standard_normal((37, 5)).astype(np.float32), rng.standard_normal(3)
    mine = np.array([world.rank, 10 * world.rank], np.uint64)
    entries = [Entry("/model/a/weight", big.shape, big.dtype, lambda lo, hi: big[lo:hi]),
               Entry("/model/a/bias", small.shape, small.dtype, lambda lo, hi: small[lo:hi]),
               Entry("/rng/pcg64", (None, 2), mine.dtype, lambda lo, hi: mine[None], per_rank=True)]
    d = _fresh_dir(world, f"pieces-{collective}")
    path = write.write_checkpoint(d, 1, entries, {"epoch": 0}, world, collective=collective)
    loaded = load_checkpoint(path, world)
    np.testing.assert_array_equal(loaded.full["/model/a/weight"], big)
    np.testing.assert_array_equal(loaded.full["/model/a/bias"], small)
    np.testing.assert_array_equal(loaded.own_rows["/rng/pcg64"], mine)
    if world.rank == 0:
        verify_file(path)

    last = min(world.size, small.size) - 1  # the last rank that holds rows of the failing array

    def failing(lo, hi):
        if world.rank == last:
            raise OSError(28, "No space left on device")
        return small[lo:hi]
    entries[1] = Entry("/model/a/bias", small.shape, small.dtype, failing)
    with pytest.raises(write.CheckpointWriteError) as err:
        write.write_checkpoint(d, 2, entries, {"epoch": 0}, world, collective=collective)
    text = str(err.value)
    assert "No space left" in text and text.count("rank ") <= 1, text
    assert (f"rank {last}:" in text) == (world.size > 1), text
    world.comm.Barrier()
    assert sorted(os.listdir(d)) == ["ckpt-00000001.h5"]  # nothing committed, no temporary left


@pytest.mark.parametrize("stage", ["_plan", "_checksums"])
def test_one_rank_failing_outside_the_data_writes_does_not_hang(world, monkeypatch, stage):
    """An exception on one rank while planning the file or checksumming: every rank raises one
    error naming that rank, promptly (the test's timeout is the hang detector), nothing committed."""
    from hpctrain.ckpt import write
    from hpctrain.ckpt.state import Entry

    real = getattr(write, stage)
    last = world.size - 1

    def failing(*args, **kwargs):
        if world.rank == last:
            raise MemoryError("injected")
        return real(*args, **kwargs)
    monkeypatch.setattr(write, stage, failing)
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    d = _fresh_dir(world, f"fail-{stage}")
    with pytest.raises(write.CheckpointWriteError, match="MemoryError: injected") as err:
        write.write_checkpoint(d, 3, [Entry("/model/a/weight", a.shape, a.dtype, lambda lo, hi: a[lo:hi])],
                               {}, world)
    assert (f"rank {last}:" in str(err.value)) == (world.size > 1)
    world.comm.Barrier()
    assert not [n for n in os.listdir(d) if n.startswith("ckpt-")]

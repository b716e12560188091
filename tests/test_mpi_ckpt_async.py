"""Background saves (``checkpoint.async_save``) under mpirun -n 1..4: a periodic save copies each
rank's share aside and a thread of its own writes, checks and commits it while training goes on.

The background writer is held back before its data writes until the training thread has run past
step 2 and changed every parameter: the file must still hold step 2, byte for byte what a
synchronous save of the same run writes, and the run must end with the same bits. A background
write that fails is one agreed error on every rank at the next save, with nothing committed.
"""

import os

import h5py
import numpy as np
import pytest

from hpctrain.training.config import Config
from whole_model import start as _start, whole as _whole

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def _config(data, ckpt_dir, background, steps=5, zero=1):
    cfg = Config()
    cfg.model.kind = "gpt"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 2, 16, 16
    cfg.data.train, cfg.train.eval_tokens = data, 0
    cfg.dist.allreduce, cfg.dist.zero, cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = "ring", zero, 0.02, 0.01
    cfg.train.global_batch, cfg.train.steps, cfg.train.dtype, cfg.train.log_every = 8, steps, "float64", 10**6
    cfg.optim.name, cfg.optim.lr = "adamw", 3e-3
    cfg.checkpoint.dir, cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes = ckpt_dir, 2, 0
    cfg.checkpoint.keep_last, cfg.checkpoint.async_save = 0, background
    return cfg.validate()


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def _datasets(path) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[...].tobytes())
                     if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("zero", [0, 3])
def test_a_background_save_holds_its_steps_state_while_training_goes_on(world, mpi_text_data, monkeypatch, zero):
    import threading
    import time

    from conftest import fresh_shared_dir
    from hpctrain.ckpt import write
    from hpctrain.ckpt.read import verify_file

    runs, real_write = {}, write.write_data
    for background in (True, False):
        d = fresh_shared_dir(world, f"async-{background}-{zero}")
        trainer = _start(_config(mpi_text_data, d, background, zero=zero), world)
        written_at = []   # (the step saved, the training thread's step when its data writes began)

        def held_back(path, entries, *args, trainer=trainer, written_at=written_at):
            if threading.current_thread().name == "hpctrain-checkpoint-writer":
                step = int(os.path.basename(path).split("-")[1].split(".")[0])
                if step == 2:
                    time.sleep(1.0)
                written_at.append((step, trainer.state.step))
            return real_write(path, entries, *args)
        monkeypatch.setattr(write, "write_data", held_back)
        trainer.run()
        trainer.close(0)
        runs[background] = d, (trainer.plan.param_slots.whole(trainer.plan.dp.comm) if zero == 3
                               else _whole(trainer)), written_at
    (d_async, p_async, written_at), (d_sync, p_sync, none) = runs[True], runs[False]
    assert not none and [s for s, _ in written_at] == [2, 4], written_at
    assert written_at[0][1] > 2, written_at   # step 2's data went out after step 3 had changed the state
    for step in (2, 4):
        name = f"ckpt-{step:08d}.h5"
        if world.rank == 0:
            verify_file(os.path.join(d_async, name))
            assert _datasets(os.path.join(d_async, name)) == _datasets(os.path.join(d_sync, name))
    if zero == 3:
        np.testing.assert_array_equal(p_async, p_sync)
    else:
        assert all(np.array_equal(p_async[k], p_sync[k]) for k in p_sync)
    world.comm.Barrier()


def test_a_failing_background_write_is_one_error_at_the_next_save(world, mpi_text_data, monkeypatch):
    from conftest import fresh_shared_dir
    from hpctrain.ckpt import write

    real, last = write._checksums, world.size - 1

    def failing(contributions):
        if world.rank == last:
            raise OSError(5, "Input/output error")
        return real(contributions)
    monkeypatch.setattr(write, "_checksums", failing)
    d = fresh_shared_dir(world, "async-fail")
    trainer = _start(_config(mpi_text_data, d, True), world)
    with pytest.raises(write.CheckpointWriteError, match="Input/output error") as err:
        trainer.run()
    assert (f"rank {last}:" in str(err.value)) == (world.size > 1)
    assert trainer.state.step == 4   # raised by the save of step 4, which waited for step 2's
    world.comm.Barrier()
    assert not [n for n in os.listdir(d) if "ckpt-" in n]   # nothing committed, no temporary left

"""Owner-written, needed-slices checkpoints (hpctrain/ckpt/ownership.py) under mpirun -n 2 and 4.

A save writes each element of every parameter and optimizer array once, from the rank that holds
it (a ZeRO chunk, a tensor piece, a stage's arrays, a data rank's range of what its data group holds
alike); a load reads only the boxes a rank's layout needs. The replicated buffers are cut into
ranges of at least ownership.MIN_PIECE_BYTES: lowered here so that every data rank owns ranges that
cut the arrays mid-row, as a large model's do. Checked per case: the owners' elements add up to the
arrays' (none written twice, none skipped), the file verifies as a whole (zlib over every byte,
against the CRC the ranks combined), and a run resumed from it at another layout trains on like an
uninterrupted run of that layout (rtol 1e-10: pipeline and tensor layouts add the tied table's and
the split layers' sums in another order; a wrong box moves parameters by whole updates).
"""

import os

import numpy as np
import pytest

from hpctrain.training.config import Config
from whole_model import start as _start, train as _train, whole as _whole

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

LAYOUTS = {"zero0": (0, 1, 1), "zero1": (1, 1, 1), "zero3": (3, 1, 1), "t2-zero1": (1, 2, 1), "p2": (0, 1, 2),
           "p2-t2-zero1": (1, 2, 2), "zero2-bf16": (2, 1, 1)}   # name: (dist.zero, t, p)


def _config(data, layout, steps, ckpt_dir="/tmp/hpctrain-unused", resume=""):
    zero, t, p = LAYOUTS[layout]
    cfg = Config()
    cfg.model.kind = "gpt"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 4, 16, 16
    cfg.data.train, cfg.train.eval_tokens = data, 0
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.02, 0.01  # several buckets: ZeRO chunks cut the arrays
    cfg.dist.allreduce, cfg.dist.zero, cfg.dist.tensor_parallel, cfg.dist.pipeline_parallel = "ring", zero, t, p
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = 16, 2, steps
    cfg.train.dtype, cfg.train.log_every = "float64", 10**6
    if layout.endswith("bf16"):   # float32 masters in the file, bf16 compute
        cfg.train.dtype, cfg.train.precision = "float32", "bf16"
    cfg.optim.name, cfg.optim.warmup_steps, cfg.optim.lr = "adamw", 2, 3e-3
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = ckpt_dir, resume, 0
    cfg.checkpoint.every_minutes, cfg.checkpoint.save_final = 0, ckpt_dir != "/tmp/hpctrain-unused"
    return cfg.validate()


def _params(trainer):
    """The whole model's logical arrays (under ZeRO-3 the whole flat parameters: t = p = 1 there)."""
    slots = trainer.plan.param_slots
    return {"flat": slots.whole(trainer.plan.dp.comm)} if slots is not None else _whole(trainer)


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


CASES = [("zero0", "zero3"), ("zero3", "t2-zero1"), ("p2-t2-zero1", "zero1"), ("t2-zero1", "p2"),
         ("zero2-bf16", "zero2-bf16")]


@pytest.mark.parametrize("saved, loaded", CASES)
def test_each_element_is_written_once_and_read_back_at_another_layout(world, mpi_text_data, monkeypatch, saved,
                                                                      loaded):
    from conftest import fresh_shared_dir
    from hpctrain.ckpt import ownership
    from hpctrain.ckpt.read import verify_file
    from hpctrain.ckpt.state import training_state

    for layout in (saved, loaded):
        _, t, p = LAYOUTS[layout]
        if world.size % (t * p) or world.size == 1:
            pytest.skip(f"{layout} needs a multiple of {t * p} ranks, and more than one (this job has {world.size})")
    monkeypatch.setattr(ownership, "MIN_PIECE_BYTES", 200)   # 25 float64s: every data rank owns some of a buffer
    d = fresh_shared_dir(world, f"owners-{saved}-{loaded}")
    trainer, _ = _train(_config(mpi_text_data, saved, 2, ckpt_dir=d), world)
    entries = [e for e in training_state(trainer.state, trainer.plan) if e.path.startswith(("/model/", "/optim/e"))]
    mine = sum(int(np.prod(count)) for e in entries for _, count, _ in e.pieces)
    assert world.comm.allreduce(mine) == sum(int(np.prod(e.shape)) for e in entries)
    assert world.comm.allreduce(int(mine > 0)) == world.size   # the bytes spread: every rank writes some
    # the accounting on paper (info --config, the start-up line) counts what the save wrote
    from hpctrain.training.plan import memory_of

    counted = memory_of(trainer.plan, trainer.model, trainer.optimizer, trainer.state.sampler)["checkpoint"]
    item = np.dtype(trainer.plan.device.dtype).itemsize
    assert counted["writes"] == mine * item and counted["file"] == sum(int(np.prod(e.shape)) for e in entries) * item
    path = os.path.join(d, "ckpt-00000002.h5")
    if world.rank == 0:
        verify_file(path)
    resumed = _start(_config(mpi_text_data, loaded, 4, ckpt_dir=d, resume="auto"), world)
    assert resumed.state.step == 2
    resumed.run()
    straight, _ = _train(_config(mpi_text_data, loaded, 4), world)
    got, want = _params(resumed), _params(straight)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)


def test_a_bad_read_of_a_box_another_rank_owns_is_caught_by_the_reader(world, mpi_text_data, monkeypatch):
    """Without ZeRO every data rank reads the whole model but owns (checksums for the file's verdict)
    only its ranges: the last rank's read of a range rank 0 owns comes back with one changed element
    (as a bad read on one node would): that rank checks what it read whole too, and every rank
    raises the same CorruptCheckpoint instead of one rank training on other numbers."""
    from conftest import fresh_shared_dir
    from hpctrain.ckpt import ownership, read
    from hpctrain.ckpt.read import CorruptCheckpoint, load_checkpoint
    from hpctrain.ckpt.state import needed_boxes, wanted

    if world.size == 1:
        pytest.skip("one rank owns every box")
    monkeypatch.setattr(ownership, "MIN_PIECE_BYTES", 200)
    d = fresh_shared_dir(world, "owners-bad-read")
    trainer, _ = _train(_config(mpi_text_data, "zero0", 1, ckpt_dir=d), world)
    layout = needed_boxes(trainer.state, trainer.plan)
    request = wanted(layout)
    path = os.path.join(d, "ckpt-00000001.h5")
    load_checkpoint(path, world, request)   # a good read passes
    real = read.read_boxes

    def bad_read(*args, **kwargs):
        attrs, meta, blocks, own, boxes = real(*args, **kwargs)
        if world.rank == world.size - 1:
            k = next(k for k, (_, _, count, owned, _) in enumerate(request) if not owned and np.prod(count))
            boxes[k] = np.array(boxes[k])
            boxes[k].reshape(-1)[0] += 1.0
        return attrs, meta, blocks, own, boxes
    monkeypatch.setattr(read, "read_boxes", bad_read)
    with pytest.raises(CorruptCheckpoint, match="fails its checksum"):
        load_checkpoint(path, world, request)

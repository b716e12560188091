"""Tensor parallelism (``dist.tensor_parallel = t``) against data parallelism, inside one MPI job
(run under mpirun -n 1..4; a case needs t to divide the world size).

The reference is the same job with t = 1, which trains like one rank with the whole batch (the
N-rank equivalence tests). Float64 throughout: a split layer's partial sums add the same products
in another grouping, so parameters and losses agree to rtol 1e-10, not bit for bit.
"""

import os
import zlib

import numpy as np
import pytest

from hpctrain.training.config import Config
from hpctrain.errors import ConfigError, UserError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _config(data, t, steps=4, optim="adamw", recompute="none", ckpt_dir="/tmp/hpctrain-unused", resume="",
            allreduce="ring"):
    cfg = Config()
    cfg.model.kind, cfg.model.recompute = "gpt", recompute
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 4, 16, 16
    cfg.data.train, cfg.train.eval_tokens = data, 256
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.02, 0.01  # several buckets
    cfg.dist.allreduce, cfg.dist.tensor_parallel = allreduce, t
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = 8, 2, steps
    cfg.train.dtype, cfg.train.log_every = "float64", 10**6
    cfg.optim.name, cfg.optim.warmup_steps, cfg.optim.weight_decay = optim, 2, 0.1
    cfg.optim.lr = 0.05 if optim == "sgd" else 3e-3
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = ckpt_dir, resume, 0
    cfg.checkpoint.every_minutes, cfg.checkpoint.save_final = 0, ckpt_dir != "/tmp/hpctrain-unused"
    return cfg.validate()


def _train(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    trainer = Trainer(cfg, world, Log(False))
    trainer.run()
    return trainer


def _logical(trainer, buf=None):
    """Every parameter's logical array (gathered over the tensor group): name -> host array."""
    model = trainer.model
    if buf is None:   # (ZeRO-3: the data group's chunks of this rank's pieces, gathered whole)
        slots = trainer.plan.param_slots
        buf = model.flat.data if slots is None else slots.whole(trainer.plan.dp.comm)
    out = {}
    for s in model.flat.slots:
        local = np.array(model.flat.view(buf, s.name))
        out[s.name] = local if model.tensor_layout is None else model.tensor_layout.logical(s.name, local)
    return out


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def _need(world, t):
    if t > world.size or world.size % t:
        pytest.skip(f"t = {t} needs a multiple of {t} ranks (this job has {world.size})")


@pytest.mark.parametrize("t,optim,recompute", [(2, "adamw", "none"), (2, "sgd", "blocks"), (4, "adamw", "none")])
def test_split_training_equals_data_parallel(world, mpi_text_data, t, optim, recompute):
    """k = 4 steps (two micro-batches each) at t ranks per tensor group: the logical parameters,
    the optimizer state and the evaluation loss equal the t = 1 run's (rtol 1e-10)."""
    _need(world, t)
    split = _train(_config(mpi_text_data, t, optim=optim, recompute=recompute), world)
    whole = _train(_config(mpi_text_data, 1, optim=optim, recompute=recompute), world)
    assert split.plan.grid.t == t and split.plan.dp.size == world.size // t
    got, want = _logical(split), _logical(whole)
    assert set(got) == set(want)
    moved = 0
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)
        moved += not np.allclose(want[name], _initial(whole, name))
    assert moved > len(want) // 2   # the runs trained: most parameters left their initial values
    for state, buf in split.optimizer.state().items():
        got_s, want_s = _logical(split, buf), _logical(whole, whole.optimizer.state()[state])
        for name in want_s:
            np.testing.assert_allclose(got_s[name], want_s[name], rtol=1e-9, atol=1e-14, err_msg=f"{state} {name}")
    a, b = split.evaluate(), whole.evaluate()
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-10)
    # replicated parameters: the same bits on every tensor rank
    for s in split.model.flat.slots:
        if s.name not in split.model.tensor_layout.splits:
            crc = zlib.crc32(np.ascontiguousarray(split.model.flat.view(split.model.flat.data, s.name)).tobytes())
            assert len(set(split.plan.grid.tensor.comm.allgather(crc))) == 1, s.name


@pytest.mark.parametrize("zero,optim", [(1, "adamw"), (2, "sgd"), (1, "lamb"), (3, "adamw")])
def test_zero_shares_of_the_tensor_pieces_train_like_t_1_zero_0(world, mpi_text_data, zero, optim):
    """dist.zero with tensor parallelism: each tensor rank's data group shares out its own pieces.
    The logical parameters and the evaluation loss equal the t = 1, zero 0 run's (rtol 1e-10);
    the replicated parameters stay the same bits on every tensor rank; a checkpoint saved this way
    holds the logical optimizer state (it resumes at t = 1, zero 0 to the uninterrupted run's
    parameters)."""
    from conftest import fresh_shared_dir

    if world.size < 4:
        pytest.skip("t = 2 with ZeRO shares needs data groups of 2: 4 ranks")
    d = fresh_shared_dir(world, f"tp-zero{zero}-{optim}")
    cfg = _config(mpi_text_data, 2, optim=optim, ckpt_dir=d, steps=3)   # (3: the schedule's lr so far is 6 steps' too)
    cfg.dist.zero = zero
    shared = _train(cfg.validate(), world)
    assert shared.plan.shards is not None and shared.plan.grid.t == 2
    whole = _train(_config(mpi_text_data, 1, optim=optim, steps=3), world)
    got, want = _logical(shared), _logical(whole)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)
    assert shared.evaluate()["loss"] == pytest.approx(whole.evaluate()["loss"], rel=1e-10)
    held = shared.model.flat.data if zero < 3 else shared.plan.param_slots.whole(shared.plan.dp.comm)
    for s in shared.model.flat.slots:
        if s.name not in shared.model.tensor_layout.splits:
            crc = zlib.crc32(np.ascontiguousarray(shared.model.flat.view(held, s.name)).tobytes())
            assert len(set(shared.plan.grid.tensor.comm.allgather(crc))) == 1, s.name
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    straight = _logical(_train(_config(mpi_text_data, 1, optim=optim, steps=6), world))
    for t, z in ((1, 0), (2, zero)):   # resumed at t = 1 zero 0, and into the same split and shares
        cfg = _config(mpi_text_data, t, optim=optim, steps=6, ckpt_dir=d, resume=f"{d}/ckpt-00000003.h5")
        cfg.dist.zero = z
        resumed = Trainer(cfg.validate(), world, Log(False))
        assert resumed.step == 3
        resumed.run()
        got = _logical(resumed)
        for name in straight:
            np.testing.assert_allclose(got[name], straight[name], rtol=1e-10, atol=1e-14, err_msg=f"t {t} {name}")


def _initial(trainer, name):
    cfg = trainer.cfg
    rng = np.random.default_rng(cfg.train.seed)
    from hpctrain.nn.transformer import gpt2_init

    for s in trainer.model.flat.slots:
        full = gpt2_init(rng, s.name, trainer.model.logical_shape(s), cfg.model.n_layer)
        if s.name == name:
            return full
    raise KeyError(name)


def test_split_blocks_forward_and_backward_equal_the_unsplit_ones(world, mpi_text_data):
    """Random weights (not GPT-2's init: biases and LayerNorms too), t = the world size: each block's
    output, the logits and every logical gradient of one forward + backward equal the unsplit
    model's on the same tokens."""
    t = world.size
    if t < 2 or 4 % t:
        pytest.skip("needs 2 or 4 ranks (t = world size divides the 4 heads)")
    from hpctrain.comm.grid import make_grid
    from hpctrain.comm.staging import Staging
    from hpctrain.device import make_device
    from hpctrain.models.gpt import GPT
    from hpctrain.nn.tensor_parallel import TensorGroup

    dev = make_device("cpu", "float64", world)
    grid = make_grid(world, t)
    group = TensorGroup(grid.tensor, dev, Staging(dev))
    whole = GPT(dev, 32, 8, 2, 4, 16)
    split = GPT(dev, 32, 8, 2, 4, 16, tensor=group)
    rng = np.random.default_rng(7)  # the same on every rank
    whole.flat.data[:] = rng.normal(0.0, 0.3, whole.flat.size)
    for s in split.flat.slots:
        split.flat.view(split.flat.data, s.name)[:] = split.tensor_layout.local(
            s.name, whole.flat.view(whole.flat.data, s.name))
    tokens = rng.integers(0, 32, (3, 8))
    targets = rng.integers(0, 32, (3, 8))
    xw, xs = whole.embedding.forward(tokens), split.embedding.forward(tokens)
    for bw, bs in zip(whole.blocks, split.blocks):
        xw, xs = bw.forward(xw, 3, 8).copy(), bs.forward(xs, 3, 8).copy()
        np.testing.assert_allclose(xs, xw, rtol=1e-12, atol=1e-13, err_msg=bw.name)
    lw, ls = whole.forward(tokens, targets), split.forward(tokens, targets)
    assert ls[0] == pytest.approx(lw[0], rel=1e-12) and ls[1] == lw[1]
    whole.backward()
    split.backward()
    for s in whole.flat.slots:
        got = split.tensor_layout.logical(s.name, np.array(split.flat.view(split.flat.grad, s.name)))
        np.testing.assert_allclose(got, whole.flat.view(whole.flat.grad, s.name), rtol=1e-10, atol=1e-13,
                                   err_msg=s.name)
    # per block: two all-reduces in each of the two forwards above, two in backward
    assert group.calls == 2 * (2 + 2 + 2) and group.elements == group.calls * 3 * 8 * 16


@pytest.mark.parametrize("saved_t,loaded_t", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_at_another_t(world, mpi_text_data, saved_t, loaded_t):
    """Saved at step 3 with one t (and data-parallel size world / t), resumed with the other to step
    6: the parameters equal an uninterrupted t = 1 run's (rtol 1e-10); the file holds logical shapes."""
    import h5py

    from conftest import fresh_shared_dir

    _need(world, 2)
    d = fresh_shared_dir(world, f"tp-{saved_t}-{loaded_t}")
    _train(_config(mpi_text_data, saved_t, steps=3, ckpt_dir=d), world)
    world.comm.Barrier()
    with h5py.File(os.path.join(d, "ckpt-00000003.h5")) as f:
        assert f["model/h/0/attn/c_attn/weight"].shape == (16, 48)
        assert f["optim/exp_avg/h/1/mlp/c_proj/weight"].shape == (64, 16)
    resumed = _train(_config(mpi_text_data, loaded_t, steps=6, ckpt_dir=d, resume="auto"), world)
    assert resumed.checkpoints.saved_path is not None
    straight = _train(_config(mpi_text_data, 1, steps=6), world)
    got, want = _logical(resumed), _logical(straight)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)


def test_a_replicated_parameter_that_drifts_apart_is_caught(world, mpi_text_data):
    """A save compares replicated parameters across each tensor group: one rank's changed LayerNorm
    weight (or Adam moment) raises the same error on every rank (those of other tensor groups too),
    before anything is written, instead of saving t different models."""
    from conftest import fresh_shared_dir

    _need(world, 2)
    d = fresh_shared_dir(world, "tp-drift")
    trainer = _train(_config(mpi_text_data, 2, steps=1, ckpt_dir=d), world)
    assert os.path.exists(os.path.join(d, "ckpt-00000001.h5"))   # in step: the save at the end went through
    flat = trainer.model.flat
    if world.rank == 1:   # tensor rank 1 of the first tensor group only
        flat.view(flat.data, "h.0.ln_1.weight")[0] += 1e-12
        flat.view(trainer.optimizer.state()["exp_avg"], "ln_f.bias")[0] += 1e-12
    trainer.step += 1
    with pytest.raises(RuntimeError, match=r"h\.0\.ln_1\.weight' differs across the tensor group.*"
                                           r"ln_f\.bias' differs"):
        trainer.checkpoints.save(trainer.state)
    assert not os.path.exists(os.path.join(d, "ckpt-00000002.h5"))


def test_bad_tensor_parallel_sizes_are_one_clear_error(world, mpi_text_data):
    """t must divide the heads (the config says so) and the world size (every rank says so alike)."""
    with pytest.raises(ConfigError, match="does not divide model.n_head=4"):
        _config(mpi_text_data, 3)
    cfg = Config()
    cfg.model.kind = "mlp"
    cfg.dist.tensor_parallel = 2
    with pytest.raises(ConfigError, match="trains data-parallel only"):
        cfg.validate()
    for compress in ("topk(0.01)", "sign"):   # chosen over whole buckets: the replicas would drift
        cfg = _config(mpi_text_data, 1)
        cfg.dist.tensor_parallel, cfg.dist.compress = 2, compress
        with pytest.raises(ConfigError, match="replicas on each tensor rank would drift apart"):
            cfg.validate()
    from hpctrain.comm.grid import check_same_reduction

    check_same_reduction([(0, 0), (0, 0)], "mpi")             # groups laid out alike: any strategy
    check_same_reduction([(0, 0, 1), (0, 1, 1)], "ring")      # ring adds in an order set by the size alone
    with pytest.raises(ConfigError, match="lie differently across the nodes"):
        check_same_reduction([(0, 0, 1), (0, 1, 1)], "hierarchical")
    t = world.size + 1   # never divides the world size (n >= 1)
    cfg = _config(mpi_text_data, 1)
    cfg.model.n_head, cfg.model.d_model, cfg.dist.tensor_parallel = t, 4 * t, t
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    # the same message on every rank (an agreed error: the CLI prints it once and every rank exits 1)
    with pytest.raises(UserError, match=f"^dist.tensor_parallel={t} does not divide the world size {world.size}"):
        Trainer(cfg.validate(), world, Log(False))


@pytest.mark.parametrize("compress", ["randk(0.25)", "powersgd(2)"])
def test_compression_over_the_data_groups_keeps_replicas_identical(world, mpi_text_data, compress):
    """Gradient compression runs over each data group (world / t ranks) with its own residuals and
    random draws; the replicated parameters' gradients are the same on every tensor rank, so their
    compressed sums must be too: after 3 steps they are bitwise equal across the tensor group, and
    the save (which checks it) goes through."""
    from conftest import fresh_shared_dir

    if world.size != 4:
        pytest.skip("runs under mpirun -n 4 (t = 2 with data groups of 2)")
    d = fresh_shared_dir(world, f"tp-compress-{compress}")
    cfg = _config(mpi_text_data, 2, steps=3, ckpt_dir=d)
    cfg.dist.compress = compress
    trainer = _train(cfg.validate(), world)
    assert trainer.compression is not None and trainer.plan.dp.size == 2
    assert os.path.exists(os.path.join(d, "ckpt-00000003.h5"))
    for s in trainer.model.flat.slots:
        if s.name not in trainer.model.tensor_layout.splits:
            crc = zlib.crc32(np.ascontiguousarray(trainer.model.flat.view(trainer.model.flat.data, s.name)).tobytes())
            assert len(set(trainer.plan.grid.tensor.comm.allgather(crc))) == 1, s.name

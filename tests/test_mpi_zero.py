"""ZeRO-1 and ZeRO-2 (``dist.zero = 1, 2``) against zero 0, inside one MPI job (run under mpirun -n 1..4).

The runs train here, on this job's ranks, in float64 with several buckets and (unless a case says
one) two micro-batches per rank. ZeRO-1 with ring and naive gives the same bits: ring's
reduce-scatter is its all-reduce's first half (the same additions in the same order), and naive's is
its whole all-reduce. mpi's MPI_Reduce_scatter may add ranks in another order than its
MPI_Allreduce, so there the runs agree to rtol 1e-10 (rounding of the 1e-16 kind per step, as the
N-rank equivalence tests allow). ZeRO-2 reduce-scatters every micro-batch, summing ranks before
micro-batches: with two micro-batches it agrees to rtol 1e-10 whatever the strategy, with one it
gives ZeRO-1's bits (ring, naive).
"""

import os

import numpy as np
import pytest

from hpctrain.training.config import Config

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _config(model, data, optim, allreduce, zero, steps=6, ckpt_dir="/tmp/hpctrain-unused", resume="", accum=2,
            bucket_mb=None):
    cfg = Config()
    if model == "gpt":
        cfg.model.kind = "gpt"
        cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 2, 16, 16
        cfg.data.train, cfg.train.eval_tokens = data, 256
        cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.02, 0.01  # ~9 K parameters: several buckets
    else:
        cfg.data.train, cfg.data.eval = data[0], ""
        cfg.model.hidden = [16, 12]
        cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.001, 0.0003  # 400 parameters: three buckets
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = 24, accum, steps
    cfg.train.dtype, cfg.train.log_every = "float64", 10**6
    cfg.optim.name, cfg.optim.warmup_steps, cfg.optim.weight_decay = optim, 2, 0.1
    cfg.optim.lr = 0.05 if optim == "sgd" else 3e-3
    cfg.dist.allreduce, cfg.dist.zero = allreduce, zero
    if bucket_mb is not None:
        cfg.dist.bucket_mb = bucket_mb
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = ckpt_dir, resume, 0
    # only runs given a directory save (the default one is shared by every job on the machine)
    cfg.checkpoint.every_minutes, cfg.checkpoint.save_final = 0, ckpt_dir != "/tmp/hpctrain-unused"
    return cfg.validate()


def _train(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    trainer = Trainer(cfg, world, Log(False))
    initial = trainer.model.flat.data.copy()
    trainer.result = trainer.run()
    return trainer, initial


def _whole_state(trainer):
    """The optimizer's state as whole flat arrays (gathered under zero 1 and 2)."""
    opt = trainer.optimizer
    if opt.shards is None:
        return {k: np.array(v) for k, v in opt.state().items()}
    return {k: opt.shards.gather(trainer.world.comm, np.asarray(v), trainer.model.flat.size)
            for k, v in opt.state().items()}


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.fixture
def data(request, mpi_small_data, mpi_text_data):
    return mpi_text_data if request.param == "gpt" else mpi_small_data


CASES = [("mlp", "sgd", "ring"), ("mlp", "sgd", "naive"), ("mlp", "sgd", "mpi"), ("mlp", "adamw", "ring"),
         ("mlp", "adamw", "mpi"), ("gpt", "adamw", "ring"), ("gpt", "adamw", "mpi"), ("gpt", "sgd", "naive")]
# (stage, micro-batches): both stages with two micro-batches everywhere; ZeRO-2 with one where it
# must then give the same bits (ring, naive)
RUNS = [(c, 1, 2) for c in CASES] + [(c, 2, 2) for c in CASES] + [(c, 2, 1) for c in CASES if c[2] != "mpi"]
_ZERO_0 = {}  # zero 0's run per (case, micro-batches): deterministic, so trained once per job


def _zero_0(model, data, optim, allreduce, accum, world):
    key = (model, optim, allreduce, accum)
    if key not in _ZERO_0:
        trainer, initial = _train(_config(model, data, optim, allreduce, 0, accum=accum), world)
        _ZERO_0[key] = trainer.model.flat.data.copy(), _whole_state(trainer), initial
    return _ZERO_0[key]


@pytest.mark.parametrize("data, optim, allreduce, stage, accum", [(*c, z, k) for c, z, k in RUNS],
                         indirect=["data"], ids=[f"{'-'.join(c)}-zero{z}-micro{k}" for c, z, k in RUNS])
def test_zero_trains_like_zero_0(world, data, optim, allreduce, stage, accum):
    model = "gpt" if isinstance(data, str) else "mlp"
    p0, s0, initial = _zero_0(model, data, optim, allreduce, accum, world)
    zero1, _ = _train(_config(model, data, optim, allreduce, stage, accum=accum), world)
    assert len(zero1.plan.buckets) >= 3  # the test is about several buckets, each cut in shares
    p1, s1 = zero1.model.flat.data, _whole_state(zero1)
    if allreduce in ("ring", "naive") and (stage == 1 or accum == 1):
        assert np.array_equal(p0, p1)
        assert all(np.array_equal(s0[k], s1[k]) for k in s0)
    else:
        np.testing.assert_allclose(p1, p0, rtol=1e-10, atol=1e-13)
        for k in s0:
            np.testing.assert_allclose(s1[k], s0[k], rtol=1e-10, atol=1e-13)
    assert np.abs(p1 - initial).max() > 1e-3  # training moved the weights
    # every rank holds the same parameters after the all-gathers
    assert np.array_equal(p1, world.comm.bcast(p1 if world.rank == 0 else None, root=0))


@pytest.mark.parametrize("allreduce", ["ring", "mpi"])
def test_each_rank_keeps_its_share_of_the_optimizer_state(world, mpi_text_data, allreduce):
    trainer, _ = _train(_config("gpt", mpi_text_data, "adamw", allreduce, 1, steps=1), world)
    opt, flat, size = trainer.optimizer, trainer.model.flat, world.size
    # the allocated arrays are the share: exp_avg and exp_avg_sq hold state_size elements each
    assert opt.exp_avg.size == opt.exp_avg_sq.size == opt.state_size == opt.shards.owned
    # the shares tile the buffer: together exactly the flat buffer, each within one element a
    # bucket of 1/size of it
    assert sum(world.comm.allgather(opt.state_size)) == flat.size
    bound = sum(-(-b.size // size) for b in trainer.plan.buckets)
    assert flat.size // size - len(trainer.plan.buckets) <= opt.state_size <= bound
    owned = np.zeros(flat.size, np.int64)
    for lo, hi, _ in opt.shards.pieces:
        owned[lo:hi] += 1
    assert np.array_equal(world.comm.allreduce(owned), np.ones(flat.size, np.int64))
    # the start-up line's accounting says so, and matches the allocated arrays
    from hpctrain.observe import memory
    from hpctrain.training.plan import memory_of

    computed = memory_of(trainer.plan, trainer.model, trainer.optimizer, trainer.state.sampler)
    assert computed["optimizer"] == opt.exp_avg.nbytes + opt.exp_avg_sq.nbytes == 2 * 8 * opt.state_size
    assert computed["params"] == computed["grads"] == flat.data.nbytes == 8 * flat.size
    assert "(zero 1: a 1/%d share)" % size in memory.describe(computed, 1, size)


@pytest.mark.parametrize("allreduce", ["ring", "mpi"])
def test_zero_2_keeps_a_few_bucket_slots_and_its_share_of_the_gradient(world, mpi_text_data, allreduce):
    cfg = _config("gpt", mpi_text_data, "adamw", allreduce, 2, steps=1)
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.005, 0.005  # ~650 values: a block spans several buckets
    cfg.model.n_layer = 6  # the blocks outweigh the tied table (4,096 of the values), which has a slot of its own
    trainer, _ = _train(cfg, world)
    slots, flat, opt, buckets = trainer.plan.grad_slots, trainer.model.flat, trainer.optimizer, trainer.plan.buckets
    # the gradients live in the slots (no P-element buffer is left) and the optimizer reads the chunks
    assert flat.grad is slots.buffer and opt.grads is slots.owned
    assert slots.owned.size == opt.shards.owned == opt.state_size
    # K rotating slots, each as large as its largest bucket, and the last bucket's own
    assert 2 <= slots.rotating < len(buckets) - 1
    sizes = {}
    for b in buckets:
        sizes[slots.slot_of[b.index]] = max(sizes.get(slots.slot_of[b.index], 0), b.size)
    assert slots.size == sum(sizes.values()) < flat.size
    assert slots.slot_of[-1] == slots.rotating and slots.slot_of.count(slots.rotating) == 1
    # every parameter's gradient view lies in its bucket's slot
    for b in buckets:
        view = slots.views[b.index]
        for name in b.slots:
            g = flat.grad_view(name)
            assert np.shares_memory(g, view) and g.size <= view.size
    from hpctrain.observe import memory
    from hpctrain.training.plan import memory_of

    computed = memory_of(trainer.plan, trainer.model, trainer.optimizer, trainer.state.sampler)
    assert computed["grads"] == slots.buffer.nbytes + slots.owned.nbytes == 8 * (slots.size + slots.owned.size)
    assert "(zero 2: bucket slots and a 1/%d share)" % world.size in memory.describe(computed, 2, world.size)
    # the chunks are this rank's 1/size share (within an element per bucket); in all less than zero 1's
    # P (from 2 ranks on: the slots fit in the other ranks' shares), and only then no warning
    assert flat.size // world.size - len(buckets) <= slots.owned.size <= flat.size // world.size + len(buckets)
    smaller = slots.size + slots.owned.size < flat.size
    assert smaller == (world.size > 1) and (memory.zero2_advice(trainer.plan, trainer.model.flat) is None) == smaller
    # few buckets: no slot to reuse, and the start-up warns
    few, _ = _train(_config("gpt", mpi_text_data, "adamw", allreduce, 2, steps=1, bucket_mb=0), world)
    assert "lower dist.bucket_mb" in memory.zero2_advice(few.plan, few.model.flat)


@pytest.mark.parametrize("allreduce", ["rhd", "hierarchical", "hierarchical@1", "hierarchical@2", "shm", "auto"])
def test_zero_with_rhd_hierarchical_shm_and_auto_trains_like_zero_0(world, mpi_text_data, mpi_shared_dir, allreduce):
    """rhd reduce-scatters by its halving alone (the ranks it folds in at non-powers of two get their
    chunk from their partner), shm by its fold alone (zero 2's slots live in its window as zero 0's
    buckets do): the same additions as zero 0, so the same bits with one micro-batch. hierarchical
    (``@k``: on simulated nodes of k ranks) by its halves in the node and across on nodes of one
    size, by its whole sum on nodes of unequal size (3 ranks as 2 + 1: the same bits), by its inner
    mpi's on one node; auto by its pick's: to rounding where the halves are MPI_Reduce_scatter."""
    from hpctrain.runtime import init_world

    allreduce, _, nodes = allreduce.partition("@")
    if nodes:
        world = init_world(ranks_per_node=int(nodes))
        if world.n_nodes == 1:
            pytest.skip("one simulated node: the case without @")
    runs = {}
    for stage in (0, 1, 2):
        cfg = _config("gpt", mpi_text_data, "adamw", allreduce, stage, accum=1)
        cfg.dist.auto_cache = os.path.join(mpi_shared_dir, f"auto-{world.size}.json")  # measured once
        cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.005, 0.005  # zero 2 reuses slots
        runs[stage], _ = _train(cfg, world)
    assert runs[2].plan.grad_slots.rotating < len(runs[2].plan.buckets) - 1
    p0 = runs[0].model.flat.data
    native = runs[1].plan.allreduce.native_halves
    one_size = world.n_nodes == 1 or world.size % int(nodes) == 0  # 3 ranks in nodes of 2: unequal
    assert native == (allreduce == "rhd" or allreduce == "hierarchical" and one_size)
    gather = type(runs[1].plan.param_gather).__name__
    assert gather == ({"rhd": "RhdAllreduce", "hierarchical": "HierarchicalAllreduce"}[allreduce] if native
                      else "NaiveAllreduce")
    for stage in (1, 2):
        # auto may pick mpi; hierarchical's halves are MPI_Reduce_scatter (across nodes or its inner mpi)
        if allreduce == "auto" or allreduce == "hierarchical" and native and world.size > 1:
            np.testing.assert_allclose(runs[stage].model.flat.data, p0, rtol=1e-10, atol=1e-13)
        else:
            assert np.array_equal(runs[stage].model.flat.data, p0)
    # the traffic counted: half an all-reduce for a reduce-scatter of the strategy's own
    bytes_1 = runs[1].result["last_step"].comm["bytes_sent"]
    dense = runs[0].result["last_step"].comm["bytes_sent"]
    assert abs(bytes_1 - dense * (2 if native else 3) / 2) <= 3


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_info_plans_the_bytes_the_trainer_allocates(world, mpi_text_data, stage):
    """planned_memory (info --config) builds nothing real, yet counts what a trainer allocates."""
    from hpctrain.training.plan import memory_of, planned_memory

    cfg = _config("gpt", mpi_text_data, "adamw", "ring", stage, steps=1, bucket_mb=0.005)
    trainer, _ = _train(cfg, world)
    assert planned_memory(cfg, world) == memory_of(trainer.plan, trainer.model, trainer.optimizer,
                                                    trainer.state.sampler)


def test_info_refuses_the_head_size_a_cuda_run_refuses(world, mpi_text_data):
    """info --config with train.device = cuda (no GPU needed): a head above the flash attention
    kernels' limit is the error a run on cuda with model.attention = flash gives, not a plan; the
    CPU's plan, and cuda's with the GEMM attention (auto, gemm), take any head."""
    from hpctrain.errors import ConfigError
    from hpctrain.training.plan import planned_memory

    cfg = _config("gpt", mpi_text_data, "adamw", "ring", 0)
    cfg.model.n_head, cfg.model.d_model = 1, 256
    assert planned_memory(cfg, world)["params"] > 256 * 256
    cfg.train.device = "cuda"
    assert planned_memory(cfg, world)["params"] > 256 * 256   # model.attention = auto
    cfg.model.attention = "flash"
    with pytest.raises(ConfigError, match="head size above the CUDA attention kernels' limit of 128"):
        planned_memory(cfg, world)


def test_zero_2_without_overlap_trains_like_zero_0(world, mpi_text_data):
    """dist.overlap = false: the main thread reduces a slot's bucket when a layer claims the slot."""
    zero0, _ = _train(_config("gpt", mpi_text_data, "adamw", "ring", 0), world)
    cfg = _config("gpt", mpi_text_data, "adamw", "ring", 2)
    cfg.dist.overlap, cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = False, 0.005, 0.005
    zero2, _ = _train(cfg, world)
    assert zero2.plan.grad_slots.rotating < len(zero2.plan.buckets) - 1  # slots are reused
    np.testing.assert_allclose(zero2.model.flat.data, zero0.model.flat.data, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("allreduce, stage", [("ring", 1), ("mpi", 1), ("ring", 2)])
def test_a_zero_checkpoint_is_logical_and_resumes_bit_exactly(world, mpi_text_data, mpi_shared_dir, allreduce, stage):
    """Saved at step 3 under zero 1 or 2, the file holds what zero 0 saves (zero 1 with ring: the same
    bits; else to rounding), and resuming it under the same stage to step 6 gives the bits of an
    uninterrupted run."""
    import h5py

    base = os.path.join(mpi_shared_dir, f"zero-resume-{allreduce}-{world.size}")
    dirs = {z: f"{base}-z{z}" for z in (0, stage)}
    for z, d in dirs.items():
        _train(_config("gpt", mpi_text_data, "adamw", allreduce, z, steps=3, ckpt_dir=d), world)
    world.comm.Barrier()
    with h5py.File(os.path.join(dirs[0], "ckpt-00000003.h5")) as f0, \
            h5py.File(os.path.join(dirs[stage], "ckpt-00000003.h5")) as f1:
        names = []
        f0.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert any(n.startswith("optim/exp_avg/") for n in names)
        for n in names:
            if n.startswith(("model/", "optim/")):
                if allreduce == "ring" and stage == 1:
                    assert np.array_equal(f0[n][()], f1[n][()]), n
                else:
                    np.testing.assert_allclose(f1[n][()], f0[n][()], rtol=1e-10, atol=1e-13, err_msg=n)
    resumed, _ = _train(_config("gpt", mpi_text_data, "adamw", allreduce, stage, steps=6, ckpt_dir=dirs[stage],
                                resume="auto"), world)
    assert resumed.checkpoints.saved_path is not None
    straight, _ = _train(_config("gpt", mpi_text_data, "adamw", allreduce, stage, steps=6), world)
    assert np.array_equal(resumed.model.flat.data, straight.model.flat.data)
    s0, s1 = _whole_state(resumed), _whole_state(straight)
    assert all(np.array_equal(s0[k], s1[k]) for k in s0)

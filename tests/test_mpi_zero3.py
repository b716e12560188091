"""ZeRO-3 (``dist.zero = 3``) against zero 0 and zero 2, inside one MPI job (run under mpirun -n 1..4).

ZeRO-3 keeps ZeRO-2's gradients (reduce-scattered into each rank's chunk every micro-batch) and its
optimizer step on the chunk; what changes is where the layers read their parameters: slots
all-gathered from every rank's chunk before each part of a layer runs. Its buckets are the model's
layer units (``dist.bucket_split = "layers"``), and every run here uses them, at every stage. A
gather copies numbers, so a zero 3 run adds in exactly the order of the zero 2 run with the same
strategy and buckets: the same bits (parameters, optimizer state, the final evaluation), asserted
for every case. Against zero 0 it then agrees as zero 2 does: bit for bit with ring and naive with
one micro-batch, else to rtol 1e-10 (ZeRO-2 sums ranks before micro-batches). The runs train in
float64.
"""

import numpy as np
import pytest

from hpctrain.training.config import Config

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def _config(model, data, optim, allreduce, zero, steps=5, accum=2, recompute="none", tensor=1, ckpt_dir="",
            resume="", eval_tokens=0):
    cfg = Config()
    if model == "gpt":
        cfg.model.kind = "gpt"
        cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 3, 2, 16, 16
        cfg.model.recompute = recompute
        cfg.data.train, cfg.train.eval_tokens = data, eval_tokens
        cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.02, 0.01  # ~13 K parameters: several buckets
    else:
        cfg.data.train, cfg.data.eval = data[0], ""
        cfg.model.hidden = [16, 12]
        cfg.dist.bucket_mb, cfg.dist.first_bucket_mb = 0.001, 0.0003  # 400 parameters: three buckets
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = 24, accum, steps
    cfg.train.dtype, cfg.train.log_every, cfg.train.eval_every = "float64", 10**6, 0
    cfg.optim.name, cfg.optim.warmup_steps, cfg.optim.weight_decay = optim, 2, 0.1
    cfg.optim.lr = 0.05 if optim in ("sgd", "lars") else 3e-3
    cfg.dist.allreduce, cfg.dist.zero, cfg.dist.tensor_parallel = allreduce, zero, tensor
    cfg.dist.bucket_split = "layers"   # ZeRO-3's buckets (its default) at every stage: the same additions
    cfg.checkpoint.dir = ckpt_dir or "/tmp/hpctrain-unused"
    cfg.checkpoint.resume, cfg.checkpoint.keep_last = resume, 0
    cfg.checkpoint.every_minutes, cfg.checkpoint.save_final = 0, bool(ckpt_dir)
    return cfg.validate()


def _train(cfg, world, resumed_at=None, before=None):
    """The trainer after its run, and the run's result (its final evaluation in "eval"); ``resumed_at``:
    the step the trainer must have resumed at (checked before it trains); ``before(trainer)``: called
    before it trains."""
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    trainer = Trainer(cfg, world, Log(False))
    if before is not None:
        before(trainer)
    if resumed_at is not None:
        assert trainer.state.step == resumed_at
    trainer.initial = np.array(trainer.model.flat.data) if not trainer.model.flat.sharded else None
    trainer.result = trainer.run()
    trainer.close(0)
    return trainer


def _whole(trainer):
    """(the parameters, the optimizer state) as whole flat host arrays, on every rank."""
    plan, opt, comm = trainer.plan, trainer.optimizer, trainer.plan.dp.comm
    size = trainer.model.flat.slots[-1].offset + trainer.model.flat.slots[-1].size
    params = plan.param_slots.whole(comm) if plan.param_slots is not None else np.array(trainer.model.flat.data)
    if opt.shards is None:
        return params, {k: np.array(v) for k, v in opt.state().items()}
    return params, {k: opt.shards.gather(comm, np.asarray(v), size) for k, v in opt.state().items()}


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.fixture
def data(request, mpi_small_data, mpi_text_data):
    return mpi_text_data if request.param == "gpt" else mpi_small_data


# (model, optimizer, strategy, micro-batches, recompute)
CASES = [("mlp", "sgd", "ring", 1, "none"), ("mlp", "adamw", "mpi", 2, "none"), ("gpt", "adamw", "naive", 1, "none"),
         ("gpt", "adamw", "ring", 1, "none"),
         ("gpt", "adamw", "ring", 2, "blocks"), ("gpt", "lamb", "naive", 2, "none"), ("gpt", "sgd", "mpi", 1, "none")]


@pytest.mark.parametrize("data, optim, allreduce, accum, recompute", CASES, indirect=["data"],
                         ids=["-".join(map(str, c)) for c in CASES])
def test_zero_3_trains_like_zero_2_bit_for_bit_and_like_zero_0(world, data, optim, allreduce, accum, recompute):
    model = "gpt" if isinstance(data, str) else "mlp"
    runs = {z: _train(_config(model, data, optim, allreduce, z, accum=accum, recompute=recompute), world)
            for z in (0, 2, 3)}
    three = runs[3]
    assert len(three.plan.buckets) >= 3 and three.model.flat.sharded
    p0, s0 = _whole(runs[0])
    p2, s2 = _whole(runs[2])
    p3, s3 = _whole(three)
    assert [b.slots for b in three.plan.buckets] == [b.slots for b in runs[2].plan.buckets]
    assert np.array_equal(p3, p2) and all(np.array_equal(s3[k], s2[k]) for k in s2)
    if allreduce in ("ring", "naive") and accum == 1:
        assert np.array_equal(p3, p0) and all(np.array_equal(s3[k], s0[k]) for k in s0)
    else:
        np.testing.assert_allclose(p3, p0, rtol=1e-10, atol=1e-13)
        for k in s0:
            np.testing.assert_allclose(s3[k], s0[k], rtol=1e-10, atol=1e-13)
    assert np.abs(p0 - runs[0].initial).max() > 1e-3   # training moved the weights
    if model == "gpt":   # the final evaluation (every rank's forwards gathering)
        assert three.result["eval"] == runs[2].result["eval"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_precision_gathers_rounded_copies_and_trains_like_zero_2(world, mpi_text_data, precision):
    """Under bf16 or fp16 the pool is in the compute dtype: each rank rounds its float32 chunk into
    the slot and the gathers move 16-bit values, half the bytes; the layers read the rounded copy a
    whole 16-bit buffer would hold, so zero 3 ends on zero 2's bits (parameters, optimizer state,
    evaluation, loss scale). fp16 starts from a loss scale that overflows: those steps are skipped
    and the scale halves at zero 3 as at zero 2."""
    from hpctrain.observe import memory

    runs = {}
    for zero in (2, 3):
        cfg = _config("gpt", mpi_text_data, "adamw", "ring", zero, steps=6, accum=2, eval_tokens=256)
        cfg.train.dtype, cfg.train.precision = "float32", precision
        cfg.train.loss_scale = 2.0 ** 24   # fp16: the first steps overflow
        runs[zero] = _train(cfg.validate(), world)
    two, three = runs[2], runs[3]
    slots, flat = three.plan.param_slots, three.model.flat
    assert slots.buffer.dtype == three.plan.precision.compute and slots.buffer.itemsize == 2
    assert slots.owned.dtype == np.float32 and flat.data is slots.buffer and flat.dtype == np.float32
    p2, s2 = _whole(two)
    p3, s3 = _whole(three)
    assert p3.dtype == np.float32
    assert np.array_equal(p3, p2) and all(np.array_equal(s3[k], s2[k]) for k in s2)
    assert three.result["eval"] == two.result["eval"]
    drawn = dict(three.model.initial_values(three.cfg.train.seed))
    initial = np.concatenate([drawn[x.name].reshape(-1) for x in flat.slots])
    assert np.abs(p3 - initial).max() > 1e-4   # trained (fp16: once the scale stopped overflowing)
    m, k = three.result["last_step"].comm, three.plan.micro_batches
    assert all(v.nbytes == 2 * b.size for v, b in zip(slots.views, slots.buckets))   # what a gather moves
    assert 2 * slots.total <= m["param_gather_bytes"] <= 2 * k * 2 * slots.total
    computed = memory.computed(three.model, three.optimizer, three.plan.device, 8, three.plan.grad_slots, 1, slots)
    assert computed["params"] == slots.buffer.nbytes + slots.owned.nbytes == 2 * slots.size + 4 * slots.owned.size
    # against zero 2's 6 bytes a parameter (float32 masters and the 16-bit copy) ZeRO-3 saves memory even
    # at one rank, where its float32 chunks are the whole model: no advice to go back to zero 2
    assert computed["params"] < 6 * slots.total and memory.zero3_advice(three.plan, flat) is None
    if precision == "fp16":
        assert three.state.loss_scale.scale == two.state.loss_scale.scale < 2.0 ** 24   # overflowed, halved


def test_a_rank_keeps_its_share_and_a_few_slots(world, mpi_text_data):
    """The parameter bytes a rank holds are its chunks plus the pool, the trainer's arrays as the
    plan counts them (the start-up line), and the chunks are 1/N of the model to one element per
    bucket. The pool: two slots the matrix buckets take in turn (each block's attention, c_fc and
    c_proj: 4 C^2 each), and slots of their own for the buckets of vectors and the token table; the
    gradients' pool is laid out alike. Together under two blocks' parameters."""
    from hpctrain.observe import memory

    cfg = _config("gpt", mpi_text_data, "adamw", "ring", 3, steps=1)
    cfg.dist.bucket_split = "auto"   # (layers, under zero 3)
    trainer = _train(cfg, world)
    plan, flat, slots = trainer.plan, trainer.model.flat, trainer.plan.param_slots
    total = slots.total
    n = world.size
    assert plan.by_layers and len(plan.buckets) == 2 + 4 * cfg.model.n_layer + 1
    assert abs(slots.owned.size - total / n) <= len(plan.buckets)
    assert world.comm.allreduce(slots.owned.size) == total
    assert flat.data is slots.buffer and flat.compute is slots.buffer and flat.data.size == slots.size
    assert plan.buckets[-1].slots == ("wte",)   # the tied table's bucket, in its own slot
    # the step's gathers in the metrics: every bucket at least once, at most twice per micro-batch (its
    # forward, and its backward for the ones evicted since)
    m = trainer.result["last_step"].comm
    assert len(plan.buckets) <= m["param_gathers"] <= 2 * plan.micro_batches * len(plan.buckets)
    assert m["param_gather_bytes"] >= total * flat.data.itemsize and m["exposed_gather_time"] >= 0
    computed = memory.computed(trainer.model, trainer.optimizer, plan.device, 8, plan.grad_slots, 1, slots)
    assert computed["params"] == (slots.buffer.nbytes + slots.owned.nbytes)
    assert computed["optimizer"] == sum(a.nbytes for a in trainer.optimizer.state().values())
    line = memory.describe(computed, 3, n)
    assert f"(zero 3: bucket slots and a 1/{n} share)" in line
    # each part of a layer reads only its own parameters (the blocks no longer fuse the next
    # LayerNorm into their output add), so the matrices rotate through two slots
    assert all(block.next_norm is None for block in trainer.model.blocks)
    C, T, own = cfg.model.d_model, cfg.model.context, slots.layout.own
    shape = {s.name: s.shape for s in flat.slots}
    vectors = [b.index for b in plan.buckets if all(len(shape[x]) == 1 for x in b.slots)]
    assert own == sorted(vectors + [len(plan.buckets) - 1]) and len(vectors) == cfg.model.n_layer + 1
    assert slots.layout.rotating == 2
    for pool in (slots, plan.grad_slots):
        assert pool.size == 2 * max(4 * C * C, T * C) + sum(plan.buckets[i].size for i in own)   # (wpe: T C)
        block = 12 * C * C + 13 * C
        assert pool.size - plan.buckets[-1].size < block   # the matrix slots, every vector and wpe... under a block
    # the layers read the pool: the whole buffers are gone (the gradients are ZeRO-2's slots)
    model = trainer.model
    for view in (model.embedding.wte, model.embedding.wpe, model.blocks[0].c_fc.w, model.blocks[-1].attn.c_attn.b,
                 model.ln_f.w):
        assert np.shares_memory(view, slots.buffer)
    assert flat.grad is plan.grad_slots.buffer and slots.size < total
    if n == 1:   # one rank's chunks are the whole model: no memory saved, and said
        assert "layer bucket(s) are too few" in memory.zero3_advice(plan, flat)


def test_evaluation_with_unequal_chunk_counts_scores_like_zero_0(world, mpi_text_data, monkeypatch):
    """A forward gathers over the data group: a rank whose evaluation shard has fewer chunks (here the
    last rank's, one chunk dropped) runs the gathers alone (no hang), and the scores are zero 0's
    with the same chunks, bit for bit (ring, one micro-batch)."""
    import hpctrain.models.gpt_data as gpt_data

    monkeypatch.setattr(gpt_data, "EVAL_WINDOWS_PER_CHUNK", 2)
    counts = {}

    def fewer_on_the_last_rank(trainer):
        shard = trainer.data.eval_shard

        def chunks(rank, size, whole=False):
            got = list(shard(rank, size, whole))
            got = got[:-1] if rank == size - 1 and size > 1 else got
            counts[whole] = len(got)
            return iter(got)

        trainer.data.eval_shard = chunks

    scores = {}
    for z in (0, 3):
        trainer = _train(_config("gpt", mpi_text_data, "adamw", "ring", z, steps=2, accum=1), world,
                         before=fewer_on_the_last_rank)
        scores[z] = trainer.result["eval"]
    per_rank = world.comm.allgather(counts[True])
    assert world.size == 1 or len(set(per_rank)) > 1, per_rank   # the final evaluation's chunks differ
    assert scores[3] == scores[0]


def test_without_overlap_the_main_thread_gathers_the_same_bits(world, mpi_text_data, monkeypatch):
    """dist.overlap = false: no gather thread is started (nothing fetched ahead; the main thread
    gathers each bucket when a layer needs it, as it reduce-scatters), and the same bits as with one."""
    import threading

    import hpctrain.comm.zero_params as zero_params

    started = []

    class Counted(threading.Thread):
        def start(self):
            started.append(self.name)
            super().start()

    monkeypatch.setattr(zero_params.threading, "Thread", Counted)   # (every thread: counted by name)
    runs = {}
    for overlap in (True, False):
        cfg = _config("gpt", mpi_text_data, "adamw", "ring", 3, steps=3)
        cfg.dist.overlap = overlap
        before = started.count("hpctrain-zero3-gather")
        trainer = _train(cfg, world)
        runs[overlap] = _whole(trainer), trainer.result["eval"], started.count("hpctrain-zero3-gather") - before
    (p1, s1), e1, threads1 = runs[True]
    (p0, s0), e0, threads0 = runs[False]
    assert threads1 == 1 and threads0 == 0
    assert np.array_equal(p0, p1) and all(np.array_equal(s0[k], s1[k]) for k in s1) and e0 == e1


@pytest.mark.parametrize("saved, resumed, precision", [(3, 0, "fp32"), (0, 3, "fp32"), (3, 1, "fp32"),
                                                       (3, 0, "bf16")])
def test_a_zero_3_checkpoint_is_logical(world, mpi_text_data, mpi_shared_dir, saved, resumed, precision):
    """Saved at one stage, resumed at another: the continued run equals the uninterrupted one at the
    resumed stage bit for bit (float64, naive with one micro-batch: zero 0, 1 and 3 give the same bits;
    bf16 over float32 masters: the file holds the masters, from which each stage rounds alike)."""
    import os

    def config(zero, steps, **kw):
        cfg = _config("gpt", mpi_text_data, "adamw", "naive", zero, steps=steps, accum=1, **kw)
        if precision != "fp32":
            cfg.train.dtype, cfg.train.precision = "float32", precision
        return cfg.validate()

    d = os.path.join(mpi_shared_dir, f"z3-{saved}-{resumed}-{precision}-{world.size}")
    _train(config(saved, 3, ckpt_dir=d), world)
    world.comm.Barrier()
    cont = _train(config(resumed, 5, ckpt_dir=d, resume="auto"), world, resumed_at=3)
    assert cont.state.step == 5
    straight = _train(config(resumed, 5), world)
    pc, sc = _whole(cont)
    ps, ss = _whole(straight)
    assert np.array_equal(pc, ps) and all(np.array_equal(sc[k], ss[k]) for k in ss)

"""Gradient compression on the GPT, inside one MPI job (run under mpirun -n 1..4).

Every compressor with every all-reduce strategy (scope all) and with scope inter (hierarchical)
trains the GPT with every rank's parameters identical and payloads smaller than float32;
PowerSGD compresses each of the GPT's matrices as the matrix it is (so it is exact when its rank
covers the gradient's); before ``dist.compress_start_step`` a compressed run is an uncompressed
one, bit for bit. Bit-exact resume with compression on the GPT is in test_mpi_compress_training.py.
Ranks form 2-rank simulated nodes (``ranks_per_node=2``), so scope inter compresses from 3 ranks up.
"""

import hashlib
import os

import numpy as np
import pytest

from tiny_gpt import gpt_config
from steps import train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

SPECS = ["fp16", "bf16", "topk(0.05)", "randk(0.2)", "sign", "powersgd(2)"]
STRATEGIES = ["mpi", "naive", "ring", "rhd", "hierarchical", "shm", "auto"]


def _trainer(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    return Trainer(cfg, world, Log(False))


def _steps(trainer, n):
    losses = [train_step(trainer).loss_sum for _ in range(n)]
    params = trainer.model.flat.data.copy()
    if hasattr(trainer.plan.allreduce, "close"):
        trainer.plan.allreduce.close()  # shm windows are freed collectively (the pytest ranks run on)
    return losses, params


@pytest.fixture(scope="module")
def node_world():
    from hpctrain.runtime import init_world

    return init_world(ranks_per_node=2)


@pytest.fixture(scope="module")
def auto_cache(mpi_shared_dir):
    """One auto measurement per world size, shared by every test here."""
    return os.path.join(mpi_shared_dir, "auto-gpt-compress.json")


@pytest.mark.parametrize("spec", SPECS)
def test_every_compressor_with_every_strategy_and_scope(node_world, mpi_text_data, auto_cache, spec):
    from hpctrain.errors import UserError

    world, problems = node_world, []
    cases = [(s, "all") for s in STRATEGIES] + [("hierarchical", "inter")]
    for allreduce, scope in cases:
        cfg = gpt_config(mpi_text_data, spec, allreduce, scope, dist={"auto_cache": auto_cache})
        if scope == "inter" and spec.startswith("powersgd"):
            with pytest.raises(UserError, match="powersgd"):  # whole layers only: refused on every rank
                _trainer(cfg, world)
            continue
        t = _trainer(cfg, world)
        c = t.compression
        losses, params = _steps(t, 2)
        digests = world.comm.allgather(hashlib.sha256(params.tobytes()).hexdigest())
        # every rank judges its own bytes (a rank outside hierarchical's cross phase sends nothing),
        # and the verdicts are gathered before asserting, so a rank failing alone cannot hang the rest
        sends = world.size > 1 and (scope == "all" or world.n_nodes > 1) and c._sum is not None
        problems += [f"{allreduce}/{scope}: {p}" for p in (
            len(t.plan.buckets) < 3 and f"{len(t.plan.buckets)} buckets", not all(np.isfinite(losses)) and f"loss {losses}",
            len(set(digests)) > 1 and "ranks differ",
            sends and not 0 < c.sent_bytes < c.dense_bytes and f"bytes {c.sent_bytes} of {c.dense_bytes}") if p]
    problems = world.comm.allgather(problems)
    assert not any(problems), problems


def test_powersgd_is_exact_when_its_rank_covers_the_gradients(mpi_text_data):
    """12 tokens per step: every weight's gradient summed over ranks has rank <= 12 (wte's <= 24:
    the head's and the embedding's parts), so rank-24 factors reproduce it up to float32 rounding
    of the wire. A layer handed to PowerSGD with a wrong shape or offset has a higher rank and
    would be approximated instead. SGD, so that rounding stays rounding (Adam would blow a
    1e-9 gradient up to a step of lr)."""
    from hpctrain.runtime import init_world

    world = init_world()
    cfg = dict(context=1, d_model=64, n_layer=1, steps=3, dtype="float64",
               optim={"name": "sgd", "lr": 0.5, "momentum": 0.9})
    exact = _trainer(gpt_config(mpi_text_data, **cfg), world)
    compressed = _trainer(gpt_config(mpi_text_data, "powersgd(24)", **cfg), world)
    shapes = [s for b in compressed.compression.shapes for s in b]
    squeezed = [s for s in shapes if compressed.compression.compressor.compresses(s)]
    assert (256, 64) in squeezed and (64, 256) in squeezed and (256, 64) in shapes  # wte, mlp.c_fc, mlp.c_proj
    assert (64, 3, 64) in squeezed  # c_attn as its three parts (q, k, v), each rank <= 12 too
    _, want = _steps(exact, 3)
    _, got = _steps(compressed, 3)
    if world.size > 1:
        assert compressed.compression.sent_bytes < compressed.compression.dense_bytes
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # rank 2 is an approximation: the same run moves elsewhere (the comparison can fail)
    _, low = _steps(_trainer(gpt_config(mpi_text_data, "powersgd(2)", **cfg), world), 3)
    assert not np.allclose(low, want, rtol=1e-5, atol=1e-7)


# ("sign", "inter") compresses only from 3 ranks up (two simulated nodes); at 1 and 2 ranks it
# checks that scope inter on one node stays the uncompressed run throughout
@pytest.mark.parametrize("spec,scope", [("topk(0.05)", "all"), ("powersgd(2)", "all"), ("sign", "inter")])
def test_before_compress_start_step_a_run_is_an_uncompressed_run(node_world, mpi_text_data, spec, scope):
    world = node_world
    # (steps=10: the cosine schedule's last step has lr = min_lr = 0, which would hide any difference)
    plain = _trainer(gpt_config(mpi_text_data, "none", "hierarchical", steps=10), world)
    warm = _trainer(gpt_config(mpi_text_data, spec, "hierarchical", scope, steps=10,
                               dist={"compress_start_step": 3}), world)
    # (a rank outside hierarchical's cross phase sends nothing in either phase)
    compressing = world.size > 1 and (scope == "all" or world.n_nodes > 1) and warm.compression._sum is not None
    verdicts = []
    for step in range(4):
        train_step(plain), train_step(warm)
        same = np.array_equal(plain.model.flat.data, warm.model.flat.data)
        c = warm.compression
        if step < 3:  # the strategy's own sum, and the bytes of it
            verdicts.append(same and c.sent_bytes == c.dense_bytes and (c.sent_bytes > 0) == compressing)
        elif compressing:  # compressed from step 3 on
            verdicts.append(not same and 0 < c.sent_bytes < c.dense_bytes)
    verdicts = world.comm.allgather(verdicts)  # gathered first: one rank failing alone cannot hang the rest
    assert all(all(v) for v in verdicts), verdicts


def _gap(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_momentum_correction_with_a_dense_compressor_is_adamw(node_world, mpi_text_data):
    """dist.compress_momentum with fp16 (which masks nothing): the ranks' velocities, summed through
    the compressor, and AdamW adding what remains of its first moment from before compression make
    the uncompressed AdamW run again, to fp16's rounding (measured 6e-5 of the parameters' norm at
    2 ranks, float64, 12 steps). Either half alone is far off (5e-2 and more, measured), so the bound
    1e-3 separates them. Scope inter (hierarchical's cross-node phase) too, where there are two
    nodes; on one node it is refused (nothing would be compressed, so no velocity summed)."""
    from hpctrain.errors import UserError

    world = node_world

    def run(compress, scope="all", allreduce="ring", momentum=True):
        cfg = gpt_config(mpi_text_data, compress, allreduce, scope, steps=14, dtype="float64",
                         optim={"freeze_step": 3}, dist={"compress_start_step": 3, "compress_momentum": momentum})
        t = _trainer(cfg, world)
        return t, _steps(t, 12)[1]

    _, plain = run("none", momentum=False)
    t, corrected = run("fp16")
    assert t.optimizer.velocity  # AdamW took the velocities on the last step
    gaps = {"all": _gap(corrected, plain)}
    if world.n_nodes > 1:
        gaps["inter"] = _gap(run("fp16", "inter", "hierarchical")[1], plain)
    else:
        with pytest.raises(UserError, match="single node"):
            run("fp16", "inter", "hierarchical")
    gaps = world.comm.allgather(gaps)
    assert all(g < 1e-3 for per_rank in gaps for g in per_rank.values()), gaps

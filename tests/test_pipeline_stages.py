"""A GPT cut into pipeline stages, in one process (no MPI): stages chained by hand run the whole
model's arithmetic, lanes hold micro-batches apart, the split is balanced, the bytes per stage are
counted, and what a pipeline cannot run is refused by the config. The MPI runs of the schedules
are tests/test_mpi_pipeline.py."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.device import CpuDevice
from hpctrain.errors import ConfigError
from hpctrain.models.gpt import GPT
from hpctrain.models.gpt_layers import StageSpan
from hpctrain.models.stage_split import balance

TINY = dict(vocab=11, context=5, n_layer=4, n_head=2, d_model=8)


def _model(counts=None, index=0, recompute="none"):
    span = None if counts is None else StageSpan.of(counts, index)
    model = GPT(CpuDevice("float64"), **TINY, recompute=recompute, span=span)
    model.init(3)
    return model


def _batch(B=3, seed=2):
    rng = np.random.default_rng(seed)
    return rng.integers(0, TINY["vocab"], (B, TINY["context"])), rng.integers(0, TINY["vocab"], (B, TINY["context"]))


def _chain(stages, lanes, x, y, B, T):
    """Forward through ``stages`` (each on its lane), the loss on the last; backward back; returns
    the mean loss."""
    inp = x
    for stage, k in zip(stages, lanes):
        out = stage.lane(k).forward(inp, B, T)
        inp = out.copy() if stage is not stages[-1] else out
    last = stages[-1]
    loss, _ = last.lane(lanes[-1]).loss.forward(out, y.reshape(-1))
    grad = None
    for stage, k in reversed(list(zip(stages, lanes))):
        dres = stage.stream_grad((B * T, TINY["d_model"])) if grad is None else grad.copy()
        grad = stage.lane(k).backward(dres, accumulate=False)
    return loss / y.size


@pytest.mark.parametrize("counts,recompute", [([2, 2], "none"), ([1, 2, 1], "blocks"), ([1, 1, 1, 1], "none")])
def test_stages_chained_run_the_whole_models_arithmetic(counts, recompute):
    """Each stage's blocks, the embedding on the first and the head on the last, chained: the same
    loss and every block's gradient bit for bit; the tied table's gradient is the head's (last
    stage) plus the embedding's (first stage), which the whole model adds in the other order."""
    whole = _model(recompute=recompute)
    stages = [_model(counts, s, recompute) for s in range(len(counts))]
    x, y = _batch()
    want_loss = whole.forward(x, y)[0] / y.size
    whole.backward()
    got_loss = _chain(stages, [0] * len(stages), x, y, *x.shape)
    assert got_loss == want_loss
    seen = set()
    for stage in stages:
        for s in stage.flat.slots:
            got, want = stage.flat.grad_view(s.name), whole.flat.grad_view(s.name)
            if s.name != "wte":
                np.testing.assert_array_equal(got, want, err_msg=s.name)
                seen.add(s.name)
            np.testing.assert_array_equal(stage.flat.view(stage.flat.data, s.name), whole.flat.view(whole.flat.data,
                                                                                                       s.name))
    assert seen == {s.name for s in whole.flat.slots} - {"wte"}
    tied = stages[0].flat.grad_view("wte") + stages[-1].flat.grad_view("wte")
    np.testing.assert_allclose(tied, whole.flat.grad_view("wte"), rtol=1e-12, atol=1e-16)
    last_names = [s.name for s in stages[-1].flat.slots]
    assert last_names[0] == "wte" and "wpe" not in last_names   # the head's copy of the table, first


def test_lanes_keep_micro_batches_apart():
    """Two micro-batches in flight on two lanes (forward, forward, backward, backward, as a pipeline
    runs them): the gradients they add up equal one lane running them one after the other."""
    counts = [2, 2]
    a = [_model(counts, s) for s in range(2)]
    b = [_model(counts, s) for s in range(2)]
    (x0, y0), (x1, y1) = _batch(2, seed=5), _batch(2, seed=6)
    B, T = x0.shape
    # b: one lane, micro-batch 0 then 1 (the second backward accumulates)
    for i, (x, y) in enumerate(((x0, y0), (x1, y1))):
        out = b[1].lane(0).forward(b[0].lane(0).forward(x, B, T).copy(), B, T)
        b[1].lane(0).loss.forward(out, y.reshape(-1))
        g = b[1].lane(0).backward(b[1].stream_grad((B * T, 8)), accumulate=i > 0)
        b[0].lane(0).backward(g.copy(), accumulate=i > 0)
    # a: both forwards first, each on its lane, then both backwards
    for k, (x, y) in enumerate(((x0, y0), (x1, y1))):
        out = a[1].lane(k).forward(a[0].lane(k).forward(x, B, T).copy(), B, T)
        a[1].lane(k).loss.forward(out, y.reshape(-1))
    for k in range(2):
        g = a[1].lane(k).backward(np.empty((B * T, 8)), accumulate=k > 0)
        a[0].lane(k).backward(g.copy(), accumulate=k > 0)
    for s in range(2):
        np.testing.assert_array_equal(a[s].flat.grad, b[s].flat.grad)
    assert len(a[0]._lanes) == 2 and a[0].lane(1).blocks[0] is not a[0].lane(0).blocks[0]


def test_every_stage_draws_the_whole_models_initial_weights():
    whole = _model()
    for s in range(3):
        stage = _model([1, 2, 1], s)
        for slot in stage.flat.slots:
            np.testing.assert_array_equal(stage.flat.view(stage.flat.data, slot.name),
                                          whole.flat.view(whole.flat.data, slot.name))
    assert [n for n, _ in whole.logical_params()] == [s.name for s in whole.flat.slots]
    assert _model([1, 2, 1], 1).flops_per_row == whole.flops_per_row   # the whole model's, on every stage


def test_activation_bytes_per_stage():
    """Stages hold their own blocks' activations; each later stage also the input it received (the
    embedding output's size): without recomputation the stages add up to the whole model plus
    p - 1 boundary arrays."""
    whole, rows = _model(), 3
    N, C = rows * TINY["context"], TINY["d_model"]
    for counts in ([2, 2], [1, 2, 1], [1, 1, 1, 1]):
        total = sum(_model(counts, s).activation_bytes(rows) for s in range(len(counts)))
        assert total == whole.activation_bytes(rows) + (len(counts) - 1) * N * C * 8


def test_the_split_is_balanced_by_parameter_count():
    """balance() against every contiguous split of up to 7 blocks into up to 4 stages: none has a
    smaller largest stage."""
    for n, p, first, last in itertools.product(range(1, 8), range(1, 5), (0, 3, 25), (0, 7)):
        if p > n:
            continue
        got = balance(n, p, 10, first, last)
        assert len(got) == p and sum(got) == n and min(got) >= 1
        cost = lambda split: max(k * 10 + (first if s == 0 else 0) + (last if s == p - 1 else 0)  # noqa: E731
                                 for s, k in enumerate(split))
        best = min(cost(c) for c in itertools.product(range(1, n + 1), repeat=p) if sum(c) == n)
        assert cost(got) == best, (n, p, first, last, got)
    assert balance(4, 2, 197_000, 48_000, 33_000) == [2, 2]


def test_a_compute_balanced_split_moves_blocks_off_the_head():
    """GPT-2 small's shape in 4 stages (12 x d768, context 1024, vocabulary 50257). By parameters the
    first and last stage each hold a 38.6 M table and get one block; by compute the embedding's
    lookup is free and the head's 6 V C = 231.6 MFLOP per token (4.5 blocks of 51.9) needs a stage of
    its own: [5, 5, 1, 1], whose slowest stage (the head's, 283.5 MFLOP per token) is the least any
    split with a block on the last stage can have. The hand-worked splits, and each the best by its
    own measure against brute force."""
    from hpctrain.models.gpt import stage_blocks

    m = SimpleNamespace(n_layer=12, d_model=768, context=1024)
    V, C, T = 50257, 768, 1024
    by_params = stage_blocks(m, 4, [], V, "parameters")
    by_compute = stage_blocks(m, 4, [], V, "compute")
    assert by_params == [1, 6, 4, 1] and by_compute == [5, 5, 1, 1]
    block_flops, head_flops = 6 * 12 * C * C + 12 * T * C, 6 * V * C
    block_params, first_params, last_params = 12 * C * C + 13 * C, (V + T) * C, V * C + 2 * C

    def worst(split, block, first, last):
        return max(k * block + (first if s == 0 else 0) + (last if s == 3 else 0) for s, k in enumerate(split))

    splits = [c for c in itertools.product(range(1, 10), repeat=4) if sum(c) == 12]
    assert worst(by_compute, block_flops, 0, head_flops) == min(worst(c, block_flops, 0, head_flops) for c in splits)
    assert worst(by_params, block_params, first_params, last_params) == min(
        worst(c, block_params, first_params, last_params) for c in splits)
    assert worst(by_compute, block_flops, 0, head_flops) < worst(by_params, block_flops, 0, head_flops)
    assert stage_blocks(m, 4, [3, 3, 3, 3], V, "compute") == [3, 3, 3, 3]   # a given split is kept


def _cfg(**dist):
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.model.kind = "gpt"
    for key, value in dist.items():
        setattr(cfg.dist, key, value)
    return cfg


def test_what_a_pipeline_cannot_run_is_refused_by_the_config():
    _cfg(pipeline_parallel=2).validate()
    _cfg(pipeline_parallel=2, pipeline_stages=[3, 1]).validate()
    cases = [
        (dict(pipeline_parallel=0), "a number of stages >= 1"),
        (dict(pipeline_parallel=5), "exceeds model.n_layer=4"),
        (dict(pipeline_parallel=2, pipeline_stages=[3, 2]), "adding up to model.n_layer=4"),
        (dict(pipeline_parallel=2, pipeline_stages=[4, 0]), "block count"),
        (dict(pipeline_parallel=1, pipeline_stages=[2, 2]), "one per stage"),
        (dict(pipeline_parallel=2, compress="topk(0.1)"), "stages hold different parameters"),
        (dict(pipeline_parallel=2, pipeline_schedule="interleaved"), "choose one of 1f1b, gpipe"),
    ]
    for dist, message in cases:
        with pytest.raises(ConfigError, match=message):
            _cfg(**dist).validate()
    cfg = _cfg(pipeline_parallel=2)
    cfg.model.kind = "mlp"
    with pytest.raises(ConfigError, match="trains data-parallel only"):
        cfg.validate()


def test_the_grid_lays_stages_out_as_consecutive_blocks_of_ranks():
    from hpctrain.comm.grid import check_divides, groups, place_of

    tensor, data, pipeline = groups(8, 2, 2)
    assert tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert data == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pipeline == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [place_of(r, 8, 2, 2) for r in (0, 3, 5, 6)] == [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]
    for r in range(8):   # every rank's groups agree with its place
        stage, d, t = place_of(r, 8, 2, 2)
        assert r in tensor[r // 2] and r in data[stage * 2 + t] and r in pipeline[r % 4]
        assert data[stage * 2 + t].index(r) == d and pipeline[r % 4].index(r) == stage
    with pytest.raises(ConfigError, match="dist.pipeline_parallel=3 x dist.tensor_parallel=1 does not divide"):
        check_divides(4, 1, 3)


def test_planned_memory_counts_the_micro_batches_each_stage_holds(text_data):
    """info --config's bytes for a p = 2 stage: 1F1B's first stage holds min(p, m) = 2 micro-batches'
    activations, its last 1; GPipe's both m = 4."""
    from hpctrain.runtime import World
    from hpctrain.training.plan import paper_run

    got = {}
    for schedule in ("1f1b", "gpipe"):
        for rank in range(2):
            cfg = _cfg(pipeline_parallel=2, pipeline_schedule=schedule)
            cfg.data.train, cfg.train.grad_accum_steps, cfg.train.device = text_data, 4, "cpu"
            plan, got[schedule, rank] = paper_run(cfg.validate(), World(None, rank, 2, None, 0, 2, None, 0, 1))
            assert plan.grid.stage == rank and plan.stage_counts == (2, 2)
    assert [got["1f1b", r]["in_flight"] for r in range(2)] == [2, 1]
    assert [got["gpipe", r]["in_flight"] for r in range(2)] == [4, 4]
    for r, held in enumerate((2, 1)):
        assert got["gpipe", r]["activations"] * held == got["1f1b", r]["activations"] * 4 > 0


def test_start_up_checks_compare_what_each_stage_must_agree_on():
    """The bucket layouts are compared within each stage (the stages hold different parameters), and
    under ZeRO the first and last stage's ranks of a pipeline group must own the same part of the
    tied table."""
    from hpctrain.training.start_up_checks import check_same_layout, check_tied_shares

    check_same_layout([(0, "a"), (0, "a"), (1, "b"), (1, "b")])
    with pytest.raises(ConfigError, match="rank 2: c"):
        check_same_layout([(0, "a"), (0, "a"), (1, "c"), (1, "b")])
    check_tied_shares([(0, (0, 8)), (1, (8, 16)), None, None, (0, (0, 8)), (1, (8, 16))])
    with pytest.raises(ConfigError, match="own different parts of the tied embedding"):
        check_tied_shares([(0, (0, 8)), (1, (8, 16)), (0, (8, 16)), (1, (0, 8))])

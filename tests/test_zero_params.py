"""ZeRO-3's parameter slots (hpctrain.comm.zero_params) on one process, without MPI: a GPT whose
parts read their parameters from the pool computes what the whole model computes, and from its
second step on every part finds its matrix bucket gathered ahead (the order the first step
recorded, recomputation's forward parts in backward included). (Training equivalence at 1-4 ranks:
tests/test_mpi_zero3.py.)"""

import numpy as np
import pytest

from hpctrain.comm.buckets import plan_buckets
from hpctrain.comm.zero import ZeroShards
from hpctrain.comm.zero_slots import vector_buckets
from hpctrain.comm.zero_params import ParameterSlots
from test_gpt_model import tiny


class _OneRank:
    """A one-rank gatherer: the rank's chunk is the whole bucket, already copied in."""

    def allgather(self, buf):
        pass


def _zero3(model):
    buckets = plan_buckets(model.flat, 8, 25.0, 1.0, units=model.layer_units)
    model.separate_layers()
    groups = [*model.forward_groups, *model.backward_groups]
    slots = ParameterSlots(buckets, ZeroShards(buckets, 0, 1, lambda rank, size: rank), model.flat, groups,
                           model.device, overlap=True, resident=vector_buckets(buckets, model.flat),
                           orders=(model.forward_groups, model.backward_groups))
    slots.adopt(model, [(s.name, np.array(model.flat.view(model.flat.data, s.name))) for s in model.flat.slots])
    slots.connect(_OneRank())
    return buckets, slots


@pytest.mark.parametrize("recompute", ["none", "blocks"])
def test_parts_read_the_pool_and_every_fetch_after_the_first_step_was_gathered_ahead(recompute):
    kw = dict(n_layer=3, d_model=8, recompute=recompute)
    whole, model = tiny(**kw), tiny(**kw)
    x = np.random.default_rng(0).integers(0, 11, (2, 5))
    y = np.random.default_rng(1).integers(0, 11, (2, 5))
    want_loss = whole.forward(x, y)
    whole.backward()
    want_grad = np.array(whole.flat.grad)

    buckets, slots = _zero3(model)
    own = slots.layout.own
    assert slots.layout.rotating == 2 and model.flat.data is slots.buffer
    late = []   # per step: the fetches whose matrix buckets were not queued before they asked
    gathers = []

    def watched(names, forward):
        wanted = {slots.bucket_of[n] for n in names}
        if any(slots._holds[slots.layout.slot_of[i]] != i for i in wanted if i not in own):
            late[-1].append((sorted(wanted), forward))
        slots.fetch(names, forward)

    try:
        for step in range(3):
            late.append([])
            slots.begin_step()
            loss = model.forward(x, y, fetch=watched)
            model.backward(fetch=watched)
            slots.end_step()
            gathers.append(slots.last_step[0])
            assert loss == want_loss
            np.testing.assert_array_equal(model.flat.grad, want_grad)
            slots.stale()   # as an update would: every bucket gathered again next step
        late.append([])   # an evaluation's forward, outside a step: the model's own order
        assert model.forward(x, y, fetch=watched) == want_loss
    finally:
        slots.close()
    # every fetch but the first (the embedding's tables) finds its matrix bucket queued ahead: the
    # first step and the evaluation by the model's order of fetches, the later steps by replaying
    # the first's
    assert all(steps == [([13, 14], True)] for steps in late), late
    if recompute == "blocks":
        # backward runs each block's forward parts again: the model's order (its claims) does not
        # say so, and the first step gathers a bucket that is evicted before use; the replay does not
        assert gathers[1] == gathers[2] < gathers[0], gathers
    else:   # the order also gathers the next bucket after backward's last part; the replay knows the step ends there
        assert gathers[1] == gathers[2] == gathers[0] - 1, gathers


@pytest.mark.parametrize("ranks", [1, 3])
def test_start_up_keeps_only_this_ranks_chunks_of_the_initial_weights(ranks):
    """ZeRO-3's model is built without a whole parameter or gradient buffer; each rank draws the
    initial weights one array at a time and keeps its chunks: the whole model's initial weights,
    chunk for chunk, on every rank of ``ranks``."""
    from hpctrain.device import CpuDevice
    from hpctrain.models.gpt import GPT

    kw = dict(vocab=11, context=5, n_layer=3, n_head=2, d_model=8)
    whole = GPT(CpuDevice("float32"), **kw)
    whole.init(7)
    got = np.zeros(whole.flat.size, np.float32)
    for rank in range(ranks):
        lazy = GPT(CpuDevice("float32"), **kw, allocate=False)
        assert lazy.flat.data is None and lazy.flat.grad is None and lazy.blocks[0].c_fc.w is None
        buckets = plan_buckets(lazy.flat, 4, 25.0, 1.0, units=lazy.layer_units)
        lazy.separate_layers()
        shards = ZeroShards(buckets, rank, ranks, lambda r, size: r)
        slots = ParameterSlots(buckets, shards, lazy.flat, [*lazy.forward_groups, *lazy.backward_groups],
                               lazy.device, resident=vector_buckets(buckets, lazy.flat))
        slots.adopt(lazy, lazy.initial_values(7))
        assert lazy.flat.data is slots.buffer and lazy.blocks[0].c_fc.w is not None
        for lo, hi, at in shards.pieces:
            got[lo:hi] = slots.owned[at:at + hi - lo]
    np.testing.assert_array_equal(got, whole.flat.data)

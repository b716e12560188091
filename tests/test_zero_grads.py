"""ZeRO-2's gradient slots (hpctrain.comm.zero_grads) on one process, without MPI: where the
gradients of each bucket live, and a backward that would write into a slot still in use is an
error, not a hang. (Training equivalence at 1-4 ranks: tests/test_mpi_zero.py.)"""

import numpy as np
import pytest

from hpctrain.comm.buckets import plan_buckets
from hpctrain.comm.zero import ZeroShards
from hpctrain.comm.zero_grads import GradientSlots, ShardedGradients
from hpctrain.device import CpuDevice
from hpctrain.nn.flat import FlatParams

NAMES = [f"p{i}" for i in range(8)]


class _Sum:
    """A one-rank strategy: its reduce-scatter leaves the buffer as it is."""

    def reduce_scatter(self, buf):
        self.calls = getattr(self, "calls", 0) + 1


def _setup(groups, overlap=False, micro_steps=1):
    dev = CpuDevice("float64")
    flat = FlatParams(dev, [(n, (16,)) for n in NAMES])
    buckets = plan_buckets(flat, 8, 16 * 8 / 2 ** 20, 16 * 8 / 2 ** 20)  # a bucket per parameter
    shards = ZeroShards(buckets, 0, 1, lambda rank, size: rank)
    slots = GradientSlots(buckets, shards, flat, groups, dev)
    flat.use_grad_layout(slots.buffer, slots.offsets)
    comm = ShardedGradients(_Sum(), slots, buckets, dev, shards, micro_steps, overlap=overlap)
    return flat, buckets, slots, comm


def test_slots_rotate_and_the_last_bucket_has_its_own():
    # backward writes a pair of parameters at a time: a group spans two buckets, so K = 3
    groups = [tuple(NAMES[i:i + 2]) for i in range(6, -1, -2)]
    flat, buckets, slots, _ = _setup(groups)
    assert len(buckets) == 8 and slots.rotating == 3
    assert slots.slot_of == [0, 1, 2, 0, 1, 2, 0, 3]
    assert slots.size == 4 * 16 and flat.grad is slots.buffer
    # buckets in one slot share its memory; each parameter's gradient is its bucket's slot
    assert np.shares_memory(slots.views[0], slots.views[3])
    assert not np.shares_memory(slots.views[0], slots.views[1])
    for b in buckets:
        (name,) = b.slots
        assert np.shares_memory(flat.grad_view(name), slots.views[b.index])


def test_resident_buckets_keep_slots_of_their_own_and_the_others_rotate_past_them():
    """ZeRO-3's layout: buckets of vectors (here buckets 2 and 5) and the last bucket keep their own
    slots; a group that reads a rotating bucket and a resident one spans one rotating bucket, so K = 2."""
    from hpctrain.comm.zero_slots import SlotLayout

    dev = CpuDevice("float64")
    flat = FlatParams(dev, [(n, (16,)) for n in NAMES])
    buckets = plan_buckets(flat, 8, 16 * 8 / 2 ** 20, 16 * 8 / 2 ** 20)
    names = [b.slots[0] for b in buckets]   # bucket i's parameter
    groups = [(names[i], names[2]) for i in (0, 1)] + [(names[i], names[5]) for i in (3, 4, 6)]
    layout = SlotLayout(buckets, flat, groups, resident=[2, 5])
    assert layout.own == [2, 5, 7] and layout.rotating == 2 and layout.count == 5
    # the rotating buckets 0, 1, 3, 4, 6 take slots 0, 1, 0, 1, 0 in turn; 2, 5 and 7 their own
    assert layout.slot_of == [0, 1, 2, 0, 1, 3, 0, 4]
    assert layout.size == 5 * 16 and sorted(set(layout.base)) == [0, 16, 32, 48, 64]
    assert SlotLayout(buckets, flat, groups).rotating == 4   # without residents a group spans up to 3 buckets


def test_a_step_reduces_each_bucket_once_per_micro_batch_into_the_owned_chunks():
    groups = [(n,) for n in reversed(NAMES)]
    flat, buckets, slots, comm = _setup(groups, micro_steps=2)
    comm.start(scale=0.5)
    for micro in range(2):
        for name in reversed(NAMES):
            comm.claim([name])
            flat.grad_view(name)[:] = float(NAMES.index(name) + 10 * micro)
            comm.mark_ready(name)
    for b in buckets:
        comm.wait(b)
    assert comm.strategy.calls == 2 * len(buckets)
    # owned (one rank: everything), packed in bucket order: (i + i + 10) / 2 for parameter i
    for b in buckets:
        (name,) = b.slots
        lo, hi, at = comm.shards.pieces[b.index]
        i = NAMES.index(name)
        assert np.all(slots.owned[at:at + hi - lo] == (2 * i + 10) * 0.5)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_claim_on_a_slot_whose_bucket_is_still_written_is_an_error_not_a_hang(overlap):
    groups = [(n,) for n in reversed(NAMES)]  # planned for one bucket at a time: K = 2
    flat, buckets, slots, comm = _setup(groups, overlap=overlap)
    assert slots.rotating == 2
    comm.start(scale=1.0)
    with pytest.raises(RuntimeError, match="backward_groups miss a claim"):
        comm.claim(list(reversed(NAMES))[:3])  # three buckets at once: the third needs the first's slot

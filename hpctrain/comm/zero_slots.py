"""The pool of slots that ZeRO-2's gradients and ZeRO-3's parameters live in, one bucket at a time.

:class:`SlotLayout` says which slot each bucket takes and where each parameter lies in the pool;
:func:`vector_buckets` names the buckets ZeRO-3 keeps in slots of their own. Both are plans, the
same on every rank: no memory is allocated here (:class:`~.zero_grads.GradientSlots` and
:class:`~.zero_params.ParameterSlots` allocate the pools).
"""

from __future__ import annotations


class SlotLayout:
    """A pool of slots for ``buckets`` of ``flat``, whose layers (``groups``: the parameter names each
    layer reads or writes together) run in bucket order, one way or the other. The last bucket (the
    first layers': the GPT's tied table) and the buckets in ``resident`` (ZeRO-3: the buckets of
    vectors, a few per cent of a block) have slots of their own; the others take K slots in turn (the
    i-th of them slot i mod K). K is one more than the most of those one layer spans, the least that
    lets the next layer's bucket be filled while the current layer's are in use. ZeRO-2's gradients
    (:mod:`.zero_grads`) and ZeRO-3's parameters (:mod:`.zero_params`) use it.

    ``rotating``: K; ``count``: the slots; ``slot_of[i]``: bucket i's slot; ``own``: the buckets with
    slots of their own; ``base[i]``: bucket i's first element in the pool; ``size``: the pool's
    elements; ``offsets``: parameter name -> its first element in the pool."""

    def __init__(self, buckets, flat, groups, resident=()):
        n = len(buckets)
        bucket_of = {name: b.index for b in buckets for name in b.slots}
        self.own = sorted(set(resident) | ({n - 1} if n else set()))
        turn = {i: r for r, i in enumerate(i for i in range(n) if i not in self.own)}   # rotating bucket -> its turn
        span = 1
        for group in groups:
            touched = [turn[bucket_of[name]] for name in group if bucket_of[name] in turn]
            if touched:
                span = max(span, max(touched) - min(touched) + 1)
        self.span = span
        self.rotating = min(span + 1, len(turn))  # K, the slots the other buckets take in turn
        self.slot_of = [turn[i] % self.rotating if i in turn else self.rotating + self.own.index(i) for i in range(n)]
        self.count = self.rotating + len(self.own)
        sizes = [0] * self.count
        for b in buckets:
            sizes[self.slot_of[b.index]] = max(sizes[self.slot_of[b.index]], b.size)
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        self.base = [starts[self.slot_of[b.index]] for b in buckets]
        self.size = sum(sizes)
        self.offsets = {s.name: self.base[bucket_of[s.name]] + s.offset - buckets[bucket_of[s.name]].lo
                        for s in flat.slots}
        self.bucket_of = bucket_of


def vector_buckets(buckets, flat) -> list:
    """The buckets that hold only vectors (1-D parameters: biases, LayerNorms): ZeRO-3 keeps them in
    slots of their own (gathered once per update, as DeepSpeed keeps its small parameters whole)."""
    shape = {s.name: s.shape for s in flat.slots}
    return [b.index for b in buckets if all(len(shape[name]) == 1 for name in b.slots)]

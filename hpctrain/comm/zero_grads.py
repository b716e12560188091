"""ZeRO-2 (``dist.zero = 2``): a bucket's gradient exists whole only while it is in flight.

Backward writes each bucket's gradients into a *slot* of a small pool (:class:`GradientSlots`, laid
out by :class:`~.zero_slots.SlotLayout`) instead of a P-element buffer: the buckets take K slots in
turn, and the last one (written first and last: the GPT's tied token table) has one of its own, as
do ZeRO-3's buckets of vectors. Before a layer writes gradients, :meth:`ShardedGradients.claim` waits
until each of its slots' previous bucket is reduced (a claim that could never be met raises). Once a
bucket is ready, the communication thread reduce-scatters its slot and copies (first micro-batch) or
adds (later ones) this rank's chunk into ``owned``, the packed gradient in
:class:`~.zero.ZeroShards`' layout that the optimizer reads; the slot is then free (without
``dist.overlap`` the main thread reduces when a claim or the optimizer needs it). Collective over the
data group, every rank in the same bucket order. :func:`make_reducer` picks this reducer or the plain
one; :func:`place_gradients` keeps the pool in shm's shared window on the CPU.

There is no whole buffer to accumulate micro-batches in, so each micro-batch is reduce-scattered and
ranks are summed before micro-batches: with k > 1 a run agrees with zero 0 and 1 to rounding, not
bit for bit. Memory and numbers: docs/dist.md.
"""

from __future__ import annotations

import threading
import time

from .buckets import BucketedAllreduce
from .reduce_ops import scale_and_test
from .zero_slots import SlotLayout


def place_gradients(strategy, model, slots, device) -> None:
    """With a strategy that offers ``allocate`` (shm, auto with shm) on the CPU, keep ``model``'s
    gradients (ZeRO-2: its ``slots``) in its shared window, so buckets are reduced without copies."""
    if not hasattr(strategy, "allocate") or device.name != "cpu":
        return
    window = strategy.allocate(slots.size if slots else model.flat.size, device.dtype)
    if slots:
        slots.move_to(window)
    model.use_grad_buffer(window, slots and slots.offsets)


def make_reducer(strategy, grad, buckets, device, shards, slots, micro_steps: int, overlap: bool = True,
                 compression=None, check_finite: bool = False, tracer=None, trace_args=None, ranges=None):
    """The trainer's bucket reducer: :class:`ShardedGradients` over ``slots`` under ZeRO-2, else a
    :class:`~.buckets.BucketedAllreduce` of the flat gradient ``grad`` (ZeRO-1 with ``shards``);
    ``tracer``, ``trace_args`` and ``ranges``: the run's spans and NVTX ranges, or None."""
    observers = dict(tracer=tracer, trace_args=trace_args, ranges=ranges)
    if slots is not None:
        return ShardedGradients(strategy, slots, buckets, device, shards, micro_steps, overlap, check_finite,
                                **observers)
    return BucketedAllreduce(strategy, grad, buckets, device, overlap=overlap, compression=compression,
                             check_finite=check_finite, shards=shards, **observers)


class GradientSlots:
    """The gradient memory of ZeRO-2 for ``buckets`` of ``flat`` (see the module docstring).

    ``buffer``: the pool on ``device``; ``offsets``: parameter name -> its gradient's first element
    in ``buffer`` (for :meth:`FlatParams.use_grad_layout`); ``views[i]``: bucket i's slot;
    ``slot_of[i]``: its slot number; ``owned``: this rank's chunks of the averaged gradient, packed.
    """

    def __init__(self, buckets, shards, flat, groups, device, resident=()):
        layout = SlotLayout(buckets, flat, groups, resident)
        self.rotating, self.slot_of, self.size, self.offsets = layout.rotating, layout.slot_of, layout.size, layout.offsets
        self.count = layout.count
        self._base, self._buckets = layout.base, list(buckets)
        self.move_to(device.zeros(self.size))
        self.owned = device.zeros(shards.owned)

    def move_to(self, buffer) -> None:
        """Keep the slots in ``buffer`` (``size`` elements; e.g. shm's shared window, so that its
        buckets are reduced without copies); the model must rebind (``use_grad_buffer``)."""
        self.buffer = buffer
        self.views = [buffer[self._base[b.index]:self._base[b.index] + b.size] for b in self._buckets]


class ShardedGradients(BucketedAllreduce):
    """:class:`~.buckets.BucketedAllreduce` for ZeRO-2: per micro-batch, every bucket of the pool
    ``slots`` (a :class:`GradientSlots`) is reduce-scattered as soon as it is ready and this rank's
    chunk kept in ``slots.owned``; after the last of ``micro_steps`` that chunk is scaled (and
    tested) and :meth:`wait` returns for it. Backward calls :meth:`claim` before writing gradients
    and :meth:`mark_ready` in every micro-batch (it overwrites: ``every_micro``)."""

    every_micro = True

    def __init__(self, strategy, slots, buckets, device, shards, micro_steps: int, overlap: bool = True,
                 check_finite: bool = False, **observers):
        self.slots, self.micro_steps = slots, micro_steps
        super().__init__(strategy, slots.buffer, buckets, device, overlap=overlap, check_finite=check_finite,
                         shards=shards, **observers)
        self._changed = threading.Condition()

    def _bucket_views(self, grad) -> list:
        return self.slots.views

    def start(self, scale: float, step: int = 0) -> None:
        super().start(scale, step)
        n = len(self.buckets)
        self._queued, self._reduced = [0] * n, [0] * n  # micro-batches of each bucket queued / reduced
        self._owner = [None] * self.slots.count  # (bucket, micro-batch) that last claimed a slot
        self._pending = []  # without overlap: ready items the main thread reduces when needed

    def claim(self, names) -> None:
        """Backward is about to write the gradients of ``names``: wait until their slots are free."""
        t0 = time.perf_counter()
        for i in sorted({self._slot_bucket[name] for name in names}):
            slot, micro = self.slots.slot_of[i], self._queued[i]
            owner = self._owner[slot]
            if owner == (i, micro):
                continue
            if owner is not None:
                b, m = owner
                if self._queued[b] <= m:  # would wait forever: the pool was planned from wrong groups
                    raise RuntimeError(f"ZeRO-2: bucket {i} needs gradient slot {slot} while bucket {b} is still "
                                       f"being written there (the model's backward_groups miss a claim)")
                self._wait_reduced(b, m)
            self._owner[slot] = (i, micro)
        self.exposed_s += time.perf_counter() - t0

    def mark_ready(self, name: str) -> None:
        i = self._slot_bucket[name]
        self._remaining[i] -= 1
        if self._remaining[i]:
            return
        micro = self._queued[i]
        self._queued[i] += 1
        self._remaining[i] = len(self.buckets[i].slots)  # for the next micro-batch
        if self.tracer is not None:
            self.tracer.instant("bucket ready", "comm", {"bucket": i, "bytes": self._views[i].nbytes, "micro": micro})
        final = micro == self.micro_steps - 1
        if not self.overlap:
            self._pending.append((i, micro))
        elif (final and i == len(self.buckets) - 1 and self._may_inline and self._error is None
              and all(e.is_set() for e in self._done[:i])):
            self._inline = True  # as in the base class: the main thread reduces it in wait()
        else:
            self._queue.put((i, micro))

    def wait(self, bucket) -> None:
        t0, i, last = time.perf_counter(), bucket.index, self.micro_steps - 1
        if self._inline and i == len(self.buckets) - 1:
            self._inline = False
            try:
                if self._error is None:
                    self._reduce_item((i, last))
            finally:
                self._item_done((i, last))
        if self.overlap:
            self._done[i].wait()
            if self._error is not None:
                raise RuntimeError("gradient reduce-scatter failed on the communication thread") from self._error
        else:
            self._wait_reduced(i, last)
        self.exposed_s += time.perf_counter() - t0

    def _wait_reduced(self, b: int, micro: int) -> None:
        """Until micro-batch ``micro`` of bucket ``b`` is reduced (without overlap: reduce it, and every
        item that became ready before it, here, in the order they became ready)."""
        if not self.overlap:
            while self._reduced[b] <= micro:
                item = self._pending.pop(0)
                try:
                    self._reduce_item(item)
                finally:
                    self._item_done(item)
            return
        with self._changed:
            self._changed.wait_for(lambda: self._reduced[b] > micro or self._error is not None)
        if self._error is not None:
            raise RuntimeError("gradient reduce-scatter failed on the communication thread") from self._error

    def _reduce_item(self, item) -> None:
        i, micro = item
        t0 = time.perf_counter()
        if self.ranges is not None:
            self.ranges.push(f"comm bucket {i}")
        view = self._views[i]
        self.strategy.reduce_scatter(view)
        lo, hi, at = self.shards.pieces[i]
        base = self.buckets[i].lo
        owned = self.slots.owned[at:at + hi - lo]
        if hi > lo:
            self.device.ops.residual_backward(view[lo - base:hi - base], owned, None, micro > 0)
        if micro == self.micro_steps - 1:
            if not scale_and_test(owned, self.scale, self.device, self.check_finite):
                self.nonfinite = True
        # backward writes into this slot next, from the main thread: the copy must be done
        self.device.synchronize()
        if self.ranges is not None:
            self.ranges.pop()
        self.comm_s += time.perf_counter() - t0
        if self.tracer is not None:
            self.tracer.complete(f"comm bucket {i}", t0, "comm",
                                 dict(self.trace_args, bucket=i, bytes=view.nbytes, micro=micro))

    def _item_done(self, item) -> None:
        i, micro = item
        with self._changed:
            self._reduced[i] = micro + 1
            self._changed.notify_all()
        if micro == self.micro_steps - 1:
            self._done[i].set()

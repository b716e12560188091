"""Gradient buckets reduced on a communication thread while backward runs (docs/dist.md).

:func:`plan_buckets` cuts the flat gradient buffer into slices (nothing copied) walking the
parameters in reverse layer order, the order backward produces them: buckets of about
``bucket_mb`` (the first ``first_bucket_mb``, so communication starts early), or one per layer unit
(``dist.bucket_split = "layers"``). During backward the model reports each final gradient
(:meth:`BucketedAllreduce.mark_ready`); a bucket whose last parameter arrives is queued, and the
communication thread reduces it while the main thread computes the layers below (a thread, because
a nonblocking Iallreduce barely progresses unless some thread keeps calling into MPI). On a GPU
mark_ready records an event, and the thread waits for that bucket's gradients only, copying on a
stream of its own (:class:`~hpctrain.device.transfers.StreamFence`). The optimizer waits for each
bucket in turn. When the thread has finished every earlier bucket, the main thread reduces the last
one itself if it is at most :data:`INLINE_MAX_BYTES` or the rank has one core. Every rank must reduce
the same buckets in the same order, or collectives pair up wrongly and hang: the trainer compares
:func:`layout_signature` across ranks before the first step.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
import time
from dataclasses import dataclass

from .reduce_ops import scale_and_test, sum_scaled


INLINE_MAX_BYTES = 1 << 20  # a last bucket this small is reduced on the main thread even with cores to spare


@dataclass(frozen=True)
class Bucket:
    index: int          # reduction order: 0 holds the last layer's parameters
    lo: int             # element range [lo, hi) of the flat buffer
    hi: int
    slots: tuple        # parameter names in the bucket

    @property
    def size(self) -> int:
        return self.hi - self.lo


def plan_buckets(flat, itemsize: int, bucket_mb: float, first_bucket_mb: float = 1.0, alone=(),
                 units=None) -> list[Bucket]:
    """Buckets over ``flat`` (a FlatParams) in reverse layer order.

    A bucket closes once it holds at least its cap of bytes, so a parameter
    larger than the cap gets a bucket of its own. ``bucket_mb <= 0`` means one
    bucket for everything (no overlap possible: it is ready only at the end).
    The parameters named in ``alone`` get a bucket of their own whatever the caps.
    ``units`` (``dist.bucket_split = "layers"``): tuples of parameter names, each contiguous in
    ``flat``, together covering it; each is one bucket, whatever the caps.
    """
    if units is not None:
        return _unit_buckets(flat, units)
    buckets, current, nbytes = [], [], 0
    for slot in reversed(flat.slots):
        if slot.name in alone:
            if current:
                buckets.append(_bucket(len(buckets), current))
            buckets.append(_bucket(len(buckets), [slot]))
            current, nbytes = [], 0
            continue
        current.append(slot)
        nbytes += slot.size * itemsize
        cap = (first_bucket_mb if not buckets else bucket_mb) * 2 ** 20
        if bucket_mb > 0 and nbytes >= cap:
            buckets.append(_bucket(len(buckets), current))
            current, nbytes = [], 0
    if current:
        buckets.append(_bucket(len(buckets), current))
    return buckets


def _unit_buckets(flat, units) -> list[Bucket]:
    unit_of = {name: u for u, unit in enumerate(units) for name in unit}
    missing = [s.name for s in flat.slots if s.name not in unit_of]
    if missing or len(unit_of) != len(flat.slots):
        raise ValueError(f"bucket units must cover the flat parameters once each (uncovered: {missing[:3]})")
    buckets, current = [], []
    for slot in reversed(flat.slots):
        if current and unit_of[slot.name] != unit_of[current[-1].name]:
            buckets.append(_bucket(len(buckets), current))
            current = []
        current.append(slot)
    if current:
        buckets.append(_bucket(len(buckets), current))
    if len(buckets) != len(units):
        raise ValueError(f"{len(units)} bucket units make {len(buckets)} contiguous runs of the flat parameters: "
                         f"a unit's parameters must lie together")
    return buckets


def _bucket(index, slots) -> Bucket:
    # reversed slots are contiguous and descending: the range spans the last and first
    return Bucket(index, slots[-1].offset, slots[0].offset + slots[0].size, tuple(s.name for s in slots))


def layout_signature(buckets, dtype) -> str:
    """A short hash of everything ranks must agree on: order, ranges, names, dtype."""
    text = repr([(b.index, b.lo, b.hi, b.slots) for b in buckets]) + str(dtype)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class BucketedAllreduce:
    """Reduces the buckets of ``grad`` with ``strategy`` (op sum, then one scale).

    Per step: :meth:`start` (with the scale factor, 1 / (world size x
    micro-steps)), :meth:`mark_ready` for every parameter during backward,
    then :meth:`wait` for each bucket. The sum and the scale are one call
    (:func:`~hpctrain.comm.reduce_ops.sum_scaled`), one pass where the strategy
    can. With ``overlap=False`` buckets are reduced on the calling thread
    inside :meth:`wait` (the baseline). With ``check_finite`` every averaged
    bucket is tested for NaN/Inf as part of its reduction; :attr:`nonfinite`
    says whether this rank found one in this step's buckets. With ``shards``
    (ZeRO, :mod:`.zero`) buckets are reduce-scattered and each rank scales and
    tests only its chunk; so does shm's window with the share each rank folds, so only the ranks' answers
    together cover the gradient: combine them over ranks (the run loop's step
    statistics sum them).
    """

    def __init__(self, strategy, grad, buckets, device, overlap: bool = True, compression=None,
                 check_finite: bool = False, shards=None, tracer=None, trace_args=None, ranges=None):
        self.strategy, self.grad, self.buckets, self.device = strategy, grad, buckets, device
        self.shards = shards  # a zero.ZeroShards: reduce-scatter, each rank scales and tests its chunk only
        self.overlap = overlap
        self.compression = compression  # a compress.gradients.GradientCompression, or None
        self.check_finite, self.nonfinite = check_finite, False
        self.step = 0
        self._slot_bucket = {name: b.index for b in buckets for name in b.slots}
        self._views = self._bucket_views(grad)
        self._done = [threading.Event() for _ in buckets]
        fence = getattr(device, "fence", None)
        self._fence = fence if overlap and fence is not None else None
        # per bucket: recorded on the device's stream when its last gradient is queued (None on the CPU)
        self._ready_events = [None if self._fence is None else self._fence.new_event() for _ in buckets]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error = None
        self._thread = None
        self._inline = False  # this step's last bucket is the main thread's (see mark_ready)
        one_core = len(os.sched_getaffinity(0)) == 1 if hasattr(os, "sched_getaffinity") else False
        self._may_inline = bool(buckets) and (one_core or self._views[-1].nbytes <= INLINE_MAX_BYTES)
        self.comm_s = self.exposed_s = 0.0
        self.bytes = sum(v.nbytes for v in self._views)
        self.tracer, self.trace_args = tracer, trace_args or {}  # train.trace: spans (hpctrain.observe.trace)
        self.ranges = ranges  # train.nvtx: NVTX ranges (hpctrain.observe.nvtx)

    claim = None         # ZeRO-2's hook before backward writes gradients (hpctrain.comm.zero_grads)
    every_micro = False  # True: backward feeds the buckets in every micro-batch, each writing afresh

    def _bucket_views(self, grad) -> list:
        """Each bucket's slice of the gradient memory (here: of the flat buffer)."""
        return [grad[b.lo:b.hi] for b in self.buckets]

    def start(self, scale: float, step: int = 0) -> None:
        """Begin global step ``step``: every bucket pending; gradients will be scaled by ``scale``."""
        self.scale, self.step = scale, step
        if self.compression is not None:
            self.compression.begin_step()
        self._remaining = [len(b.slots) for b in self.buckets]
        for event in self._done:
            event.clear()
        self.comm_s = self.exposed_s = 0.0
        self.nonfinite = False
        self._inline = False
        if self.overlap and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hpctrain-comm", daemon=True)
            self._thread.start()

    def mark_ready(self, name: str) -> None:
        """The gradient of parameter ``name`` is final for this step (called by backward)."""
        i = self._slot_bucket[name]
        self._remaining[i] -= 1
        if self._remaining[i] == 0 and self.tracer is not None:
            self.tracer.instant("bucket ready", "comm", {"bucket": i, "bytes": self._views[i].nbytes})
        if self._remaining[i] == 0 and self.overlap:
            if self._fence is not None:
                self._fence.record(self._ready_events[i])
            if (i == len(self.buckets) - 1 and self._may_inline and self._error is None
                    and all(e.is_set() for e in self._done[:i])):
                # the thread is idle and backward is over: the main thread reduces it in wait(),
                # so collectives still run one at a time, in bucket order, on every rank
                self._inline = True
            else:
                self._queue.put(i)

    def wait(self, bucket: Bucket) -> None:
        """Block until ``bucket`` is reduced (reduce it here when not overlapping)."""
        t0 = time.perf_counter()
        if self._inline and bucket.index == len(self.buckets) - 1:
            self._inline = False
            try:
                if self._error is None:  # never a collective after a failed one
                    self._reduce(bucket.index)
            finally:
                self._done[bucket.index].set()
        if self.overlap:
            self._done[bucket.index].wait()
            if self._error is not None:
                raise RuntimeError("gradient all-reduce failed on the communication thread") from self._error
        else:
            self._reduce(bucket.index)
        self.exposed_s += time.perf_counter() - t0

    def _reduce(self, i: int) -> None:
        t0 = time.perf_counter()
        if self.ranges is not None:
            self.ranges.push(f"comm bucket {i}")
        view = self._views[i]
        if self.shards is not None:
            self.strategy.reduce_scatter(view)
            lo, hi, _ = self.shards.pieces[i]
            base = self.buckets[i].lo
            finite = scale_and_test(view[lo - base:hi - base], self.scale, self.device, self.check_finite)
        elif self.compression is not None:
            self.compression.reduce(view, i, self.step)
            finite = scale_and_test(view, self.scale, self.device, self.check_finite)
        else:  # sum, average and test in one pass where the strategy can (shm's window)
            finite = sum_scaled(self.strategy, view, self.scale, self.device, self.check_finite)
        if not finite:
            self.nonfinite = True
        if self.ranges is not None:
            self.ranges.pop()
        self.comm_s += time.perf_counter() - t0
        if self.tracer is not None:
            self.tracer.complete(f"comm bucket {i}", t0, "comm", dict(self.trace_args, bucket=i, bytes=view.nbytes))

    def _run(self) -> None:
        ctx = getattr(self.device, "thread_context", contextlib.nullcontext)
        with ctx():  # a CUDA device must be current in this thread too
            while True:
                item = self._queue.get()
                try:
                    if self._error is None:
                        self._reduce_item(item)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                    self._error = exc
                finally:
                    self._item_done(item)

    # what the communication thread does with a queued item (ZeRO-2's items are (bucket, micro-batch))
    def _reduce_item(self, i) -> None:
        fence = self._fence
        with fence.fenced(self._ready_events[i]) if fence is not None else contextlib.nullcontext():
            self._reduce(i)

    def _item_done(self, i) -> None:
        self._done[i].set()

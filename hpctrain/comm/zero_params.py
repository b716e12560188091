"""ZeRO-3 (``dist.zero = 3``): a layer's parameters exist whole only while it runs.

Each rank keeps, of the parameters, only its chunk of every bucket (the shares ZeRO-1 and 2 use,
:class:`~.zero.ZeroShards`), packed: :attr:`ParameterSlots.owned`, the masters the optimizer
updates. The layers read their parameters from a small pool of *slots* (:class:`~.zero_grads.SlotLayout`,
the layout of ZeRO-2's gradient slots): buckets 0 .. n-2 take K slots in turn and the last bucket
has one of its own. Before a layer runs, forward or backward, the model calls :meth:`ParameterSlots.fetch`
with its parameter names; each bucket they lie in is all-gathered into its slot from every rank's
chunk (the parameter all-gather of ZeRO-1, here before use instead of after the update), unless
the slot still holds it, and the bucket the layer after it will need is gathered ahead (prefetched)
on a thread of its own while this layer computes.

- **Order.** Layers run in bucket order, down in forward (bucket n-1 first) and up in backward.
  The bucket fetched ahead is the next one that way. Its slot's current bucket is never one this
  layer uses: K is one more than the most buckets a layer spans.
- **The last bucket** holds the first parameters in the flat order: for the GPT the tied token
  table (with what shares its bucket: the position table, perhaps some of the first block's), which
  the embedding reads at the start of forward and the head at its end and at the start of backward.
  Its own slot keeps it gathered from its first use to the update, as FSDP keeps its root unit. A
  fetch of that bucket alone fetches nothing ahead, since it says nothing about what runs next.
  The buckets are ZeRO-2's, so a ZeRO-3 step adds in ZeRO-2's order: the same bits.
- **Staleness.** An update changes the masters. From the bucket's update on, its slot's copy is
  stale (:meth:`ParameterSlots.stale`), so the next use gathers it again. So does a checkpoint
  load (:meth:`ParameterSlots.load`).
- **Gradients** are ZeRO-2's: the reused gradient slots, each reduce-scattered into the owner's
  chunk (:mod:`.zero_grads`).

Every rank issues the same gathers in the same order (the same layers, the same residency), on a
duplicate communicator of the data group (ZeRO-1's parameter gatherer), from one thread, so they
pair up. Without ``dist.overlap`` they run on the main thread when a layer needs them, and nothing is
fetched ahead.

On a GPU a gather copies through the staging path, which first waits for the device's queued work
(the layer computing now included): there the gathers do not overlap compute yet.

Memory per rank: the owned chunks (about P / N) and the pool (K slots of the largest bucket each,
plus the last bucket). At start-up the whole parameter buffer exists once (the initial weights,
drawn and broadcast), is cut into the owned chunks and dropped.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import numpy as np

from .zero_grads import SlotLayout


class ParameterSlots:
    """ZeRO-3's parameters for ``buckets`` of ``flat`` (see the module docstring): ``owned``, this
    rank's chunks (``shards``) packed on ``device``; ``buffer``, the pool the layers read;
    ``offsets``, each parameter's place in it. :meth:`adopt` takes the shares from the model's whole
    buffer and moves the model onto the pool; ``gatherer`` (ZeRO-1's parameter all-gather strategy,
    its ``allgather(buf)`` filling every chunk of a bucket from its owner) is set by :meth:`connect`."""

    def __init__(self, buckets, shards, flat, groups, device, overlap: bool = True):
        layout = SlotLayout(buckets, flat, groups)
        # without dist.overlap the gathers run on the main thread, when needed (no second thread calls MPI)
        self.overlap = overlap
        self.layout, self.buckets, self.shards, self.device = layout, list(buckets), shards, device
        self.total = flat.size   # the whole parameter count
        self.size, self.offsets, self.bucket_of = layout.size, layout.offsets, layout.bucket_of
        self.buffer = device.zeros(self.size)
        self.owned = device.zeros(shards.owned)
        self.views = [self.buffer[b:b + bk.size] for b, bk in zip(layout.base, self.buckets)]
        self._holds: list = [None] * (layout.rotating + 1)   # slot -> the bucket it holds (or is being filled with)
        self._ready: dict = {}     # bucket -> an Event set once its gather is done
        self._error = None
        self._tasks = queue.Queue()
        self._thread = None
        self.gatherer = None
        self.watchdog = None
        self.gathers = 0            # all-gathers queued since begin_step (the prefetched ones too)
        self.bytes = 0              # and their bytes (the whole buckets)
        self.exposed_s = 0.0        # seconds the layers waited for a gather
        self.last_step = (0, 0, 0.0)   # (gathers, bytes, exposed seconds) of the last training step

    # ---- set-up ----------------------------------------------------------------------
    def adopt(self, model) -> None:
        """Cut this rank's chunks out of ``model``'s whole parameter buffer (the initial weights,
        identical on every rank of the data group), then move the model onto the pool (the whole
        buffer dropped and, on a GPU, freed now). Local."""
        flat = model.flat
        for lo, hi, at in self.shards.pieces:
            if hi > lo:
                self.device.ops.residual_backward(flat.data[lo:hi], self.owned[at:at + hi - lo], None, False)
        self.device.synchronize()
        model.use_param_buffer(self.buffer, self.offsets)
        getattr(self.device, "release_freed", lambda: None)()
        self._holds = [None] * len(self._holds)

    def connect(self, gatherer, watchdog=None) -> None:
        """The all-gather strategy (a duplicate communicator of the data group) and the run's watchdog."""
        self.gatherer, self.watchdog = gatherer, watchdog

    def close(self) -> None:
        """Stop the gather thread after the queued gathers (it is a daemon: one stuck in a collective
        whose peers are gone does not keep the process)."""
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    # ---- use -------------------------------------------------------------------------
    def fetch(self, names, forward: bool) -> None:
        """A layer about to read the parameters ``names`` (in ``forward``, or backward): each of their
        buckets gathered into its slot unless it is there, and the next bucket that way fetched ahead."""
        wanted = sorted({self.bucket_of[name] for name in names})
        if not wanted:
            return
        last = len(self.buckets) - 1
        for i in wanted:
            self._start(i, wanted)
        t0 = time.perf_counter()
        for i in wanted:
            self._wait(i)
        self.exposed_s += time.perf_counter() - t0
        if wanted == [last]:
            return
        ahead = wanted[0] - 1 if forward else wanted[-1] + 1
        if self.overlap and 0 <= ahead < last:
            self._start(ahead, wanted)

    def stale(self, index: int | None = None) -> None:
        """Bucket ``index``'s masters changed (every bucket's with None): its slot's copy is not used again."""
        t0 = time.perf_counter()
        for i in (range(len(self.buckets)) if index is None else [index]):
            slot = self.layout.slot_of[i]
            if self._holds[slot] == i:
                self._wait(i)          # a gather still filling the slot (it reads the masters) finishes first
                self._holds[slot] = None
        self.exposed_s += time.perf_counter() - t0

    def begin_step(self) -> None:
        """A training step starts: the counters from zero."""
        self.gathers, self.bytes, self.exposed_s = 0, 0, 0.0

    def end_step(self) -> None:
        """A training step ended: its counters kept as :attr:`last_step` (an evaluation's gathers that
        follow are not the step's)."""
        self.last_step = (self.gathers, self.bytes, self.exposed_s)

    # ---- checkpoints -----------------------------------------------------------------
    def whole(self, comm) -> np.ndarray:
        """Every parameter on the host, in the flat layout (collective over ``comm``, the data group)."""
        return self.shards.gather(comm, self.device.to_host(self.owned), self.total)

    def load(self, host_flat: np.ndarray) -> None:
        """This rank's chunks of the whole parameters ``host_flat`` (a restore); every slot stale. Local."""
        self.stale()
        self.device.copy_from_host(self.owned, self.shards.take(np.asarray(host_flat, self.owned.dtype)))

    # ---- gathers -----------------------------------------------------------------------
    def _start(self, i: int, in_use) -> None:
        """Queue bucket ``i``'s gather into its slot unless the slot holds it (or is being filled with it)."""
        slot = self.layout.slot_of[i]
        held = self._holds[slot]
        if held == i:
            return
        if held is not None and held in in_use:   # would overwrite what this layer reads: a planning error
            raise RuntimeError(f"ZeRO-3: bucket {i} needs parameter slot {slot}, which holds bucket {held} that "
                               f"the same layer reads (the model's backward_groups miss a layer)")
        if held is not None:
            t0 = time.perf_counter()
            self._wait(held)   # its gather (if still running) finishes before the slot is refilled
            self.exposed_s += time.perf_counter() - t0
        self._holds[slot] = i
        self.gathers += 1
        self.bytes += self.views[i].nbytes
        done = self._ready[i] = threading.Event()
        if not self.overlap:
            try:
                self._gather(i)
            finally:
                done.set()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="hpctrain-zero3-gather", daemon=True)
            self._thread.start()
        self._tasks.put((i, done))

    def _wait(self, i: int) -> None:
        done = self._ready.get(i)
        if done is None or done.is_set():
            self._raise()
            return
        watch = self.watchdog.watch("parameter all-gather", f"bucket {i + 1} of {len(self.buckets)}") \
            if self.watchdog is not None else None
        if watch is None:
            done.wait()
        else:
            with watch:
                done.wait()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("ZeRO-3 parameter all-gather failed on the gather thread") from self._error

    def _serve(self) -> None:
        context = getattr(self.device, "thread_context", None)
        with context() if context is not None else contextlib.nullcontext():
            while True:
                task = self._tasks.get()
                if task is None:
                    return
                i, done = task
                try:
                    if self._error is None:
                        self._gather(i)
                except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                    self._error = e
                finally:
                    done.set()

    def _gather(self, i: int) -> None:
        """Bucket ``i`` whole in its slot: this rank's chunk copied in, the others all-gathered."""
        bucket, view = self.buckets[i], self.views[i]
        lo, hi, at = self.shards.pieces[i]
        if hi > lo:
            self.device.ops.residual_backward(self.owned[at:at + hi - lo], view[lo - bucket.lo:hi - bucket.lo],
                                              None, False)
        self.gatherer.allgather(view)
        self.device.synchronize()   # the layers read the slot next, from the main thread

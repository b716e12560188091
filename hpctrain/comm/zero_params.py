"""ZeRO-3 (``dist.zero = 3``): parameters in shares; a layer's exist whole only while it runs.

:class:`ParameterSlots` holds ``owned``, this rank's chunks packed (ZeRO-1's shares,
:class:`~.zero.ZeroShards`: the float32 masters the optimizer updates), and ``buffer``, the pool of
slots the layers read (:class:`~.zero_slots.SlotLayout`). The buckets are the model's layer units;
the matrix buckets take K slots in turn (K = 2 for the GPT), the buckets of vectors and the last
bucket (the GPT's token table) have slots of their own and stay gathered until their update. Before
each part of a layer runs, forward or backward, the model calls :meth:`~ParameterSlots.fetch` with
the names it reads: each of their buckets is all-gathered into its slot unless the slot holds it, and
with ``dist.overlap`` the next part's are gathered ahead on a thread of its own, in the order the last
training step fetched (the first step, an evaluation: the model's own order). An update or a load
makes a bucket's copy stale. Gradients are ZeRO-2's slots (:mod:`.zero_grads`).

Collective over a duplicate communicator of the data group: every rank issues the same gathers in the
same order, from one thread. On a GPU a gather waits only for the event recorded when it was queued
(the slot's last readers, the masters' update), not for the part about to run. Under a 16-bit
``train.precision`` the pool is in the compute dtype: a gather rounds this rank's chunk and moves
16-bit values. Start-up keeps only this rank's chunks of the initial weights (:meth:`~ParameterSlots.adopt`;
nothing broadcast). Memory, prefetch, same bits: docs/dist.md.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import numpy as np

from .zero_slots import SlotLayout


class ParameterSlots:
    """ZeRO-3's parameters for ``buckets`` of ``flat`` (see the module docstring): ``owned``, this
    rank's chunks (``shards``) packed on ``device``; ``buffer``, the pool the layers read;
    ``offsets``, each parameter's place in it. :meth:`adopt` takes this rank's shares of the initial
    weights and moves the model onto the pool; ``gatherer`` (ZeRO-1's parameter all-gather strategy,
    its ``allgather(buf)`` filling every chunk of a bucket from its owner) is set by :meth:`connect`."""

    def __init__(self, buckets, shards, flat, groups, device, overlap: bool = True, resident=(), orders=((), ()),
                 dtype=None):
        layout = SlotLayout(buckets, flat, groups, resident)
        # without dist.overlap the gathers run on the main thread, when needed (no second thread calls MPI)
        self.overlap = overlap
        self.layout, self.buckets, self.shards, self.device = layout, list(buckets), shards, device
        self.total = flat.size   # the whole parameter count
        self.size, self.offsets, self.bucket_of = layout.size, layout.offsets, layout.bucket_of
        # the pool in the compute dtype (``dtype``; the masters' by default): under a 16-bit precision
        # each rank rounds its chunk into the slot and the gather moves 16-bit values, half the bytes
        self.buffer = device.zeros(self.size, dtype) if dtype is not None else device.zeros(self.size)
        self.owned = device.zeros(shards.owned)
        self._narrowed = np.dtype(self.buffer.dtype) != np.dtype(self.owned.dtype)
        self.views = [self.buffer[b:b + bk.size] for b, bk in zip(layout.base, self.buckets)]
        self._holds: list = [None] * layout.count   # slot -> the bucket it holds (or is being filled with)
        self._order: list = []      # the buckets each fetch of the last training step wanted, in order
        self._recording: list | None = None   # this step's, while one runs
        self._pos = 0               # this step's fetches so far
        # the model's own order of fetches (forward, backward: ``orders``, name tuples), followed where
        # no step was recorded (the first, an evaluation); a cursor in each, past the last match
        self._planned = {fwd: [tuple(sorted({self.bucket_of[n] for n in g})) for g in order if g]
                         for fwd, order in zip((True, False), orders)}
        self._cursor = {True: 0, False: 0}
        self._ready: dict = {}     # bucket -> an Event set once its gather is done
        # on a GPU (a fence with a stream), with overlap: per slot an event, recorded on the device's
        # stream as a gather into it is queued (what the gather thread waits for), made once
        fence = getattr(device, "fence", None)
        self._fence = fence if overlap and getattr(fence, "stream", None) is not None else None
        self._slot_events: list = [None] * layout.count
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
    def adopt(self, model, values) -> None:
        """This rank's chunks of the initial weights ``values`` ((name, host array) pairs, every
        parameter of ``model`` once, one at a time: each rank draws the same, so nothing is
        broadcast), then the model onto the pool. The model was built without a whole parameter
        buffer, so at no point does a rank hold every parameter (on the host: one array and its
        chunks; on the device: its chunks). Local."""
        slot = {s.name: s for s in model.flat.slots}
        host = np.zeros(self.owned.size, self.owned.dtype)
        seen = set()
        for name, value in values:
            s, flat = slot[name], np.asarray(value).reshape(-1)
            lo, hi, at = self.shards.pieces[self.bucket_of[name]]   # the part of its bucket this rank owns
            a, b = max(lo, s.offset), min(hi, s.offset + s.size)
            if a < b:
                host[at + a - lo:at + b - lo] = flat[a - s.offset:b - s.offset]
            seen.add(name)
        if seen != set(slot):
            raise ValueError(f"ZeRO-3 start-up: no initial value for {sorted(set(slot) - seen)[:3]}")
        self.device.copy_from_host(self.owned, host)
        model.use_param_buffer(self.buffer, self.offsets)
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
        buckets gathered into its slot unless it is there, and the next layer's fetched ahead: the
        buckets the next fetch of the last training step wanted, while this step follows it; else
        what follows in the model's own order of fetches that way."""
        wanted = sorted({self.bucket_of[name] for name in names})
        if not wanted:
            return
        for i in wanted:
            self._start(i, wanted)
        t0 = time.perf_counter()
        for i in wanted:
            self._wait(i)
        self.exposed_s += time.perf_counter() - t0
        pos, key = self._pos, tuple(wanted)
        self._pos += 1
        if self._recording is not None:
            self._recording.append(key)
        if not self.overlap:
            return
        if self._recording is not None and pos < len(self._order) and self._order[pos] == key:
            ahead = self._ahead(self._order, pos + 1)   # (nothing after the step's last fetch: the update comes next)
        else:
            ahead = self._from_plan(key, forward)
        for i in ahead:
            held = self._holds[self.layout.slot_of[i]]
            if held != i and held not in wanted:   # never over what this layer reads
                self._start(i, wanted)

    def _ahead(self, order: list, pos: int) -> list:
        """The buckets the fetches of ``order`` from ``pos`` on want, up to the first that wants a
        rotating one (the vectors' fetches between, which hold their own slots, are no layer's wait)."""
        out = []
        own = self.layout.own
        for key in order[pos:]:
            out += key
            if any(i not in own for i in key):
                break
        return out

    def _from_plan(self, key: tuple, forward: bool) -> list:
        """What follows ``key`` in the model's own order of fetches that way (from the cursor on, so a
        part that wants the same buckets as an earlier one, a block's two LayerNorms, is told apart);
        nothing if ``key`` is not in it (recomputation's forward parts inside backward)."""
        order, start = self._planned[forward], self._cursor[forward]
        for at in (*range(start, len(order)), *range(0, min(start, len(order)))):
            if order[at] == key:
                self._cursor[forward] = at + 1
                return self._ahead(order, at + 1)
        return []

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
        """A training step starts: the counters from zero; its fetches are recorded (the next step
        fetches ahead in their order)."""
        self.gathers, self.bytes, self.exposed_s = 0, 0, 0.0
        self._recording, self._pos = [], 0
        self._cursor = {True: 0, False: 0}

    def end_step(self) -> None:
        """A training step ended: its counters kept as :attr:`last_step` (an evaluation's gathers that
        follow are not the step's), its fetches as the order to follow."""
        self.last_step = (self.gathers, self.bytes, self.exposed_s)
        if self._recording is not None:
            self._order, self._recording = self._recording, None

    # ---- checkpoints -----------------------------------------------------------------
    def whole(self, comm) -> np.ndarray:
        """Every parameter on the host, in the flat layout (collective over ``comm``, the data group; the
        tests' reference: checkpoints write and read this rank's chunks, :mod:`hpctrain.ckpt.ownership`)."""
        return self.shards.gather(comm, self.device.to_host(self.owned), self.total)

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
        if self._fence is not None:   # after every kernel queued so far: the slot's readers, the masters' update
            event = self._slot_events[slot] = self._slot_events[slot] or self._fence.new_event()
            self._fence.record(event)   # (re-recorded only once the slot's last gather is done)
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
        """Bucket ``i`` whole in its slot: this rank's chunk copied in, the others all-gathered. Fenced
        (a GPU, with overlap; the module docstring): after the event :meth:`_start` recorded, on this
        thread's own stream; else after the device's queued work."""
        fence = self._fence
        if fence is None:
            self._fill(i, None)
            self.device.synchronize()   # the layers read the slot next, from the main thread
            return
        event = self._slot_events[self.layout.slot_of[i]]   # recorded as this gather was queued
        with fence.fenced(event):
            event.synchronize()   # the slot's last reader done, the masters updated (the device's stream goes on)
            self._fill(i, fence.transfer_stream())
        # (the staging's copy back is queued on this thread's stream; the device's waits for it: transfer_done)

    def _fill(self, i: int, stream) -> None:
        """Bucket ``i``'s slot: this rank's chunk rounded or copied in (queued on ``stream``, or the
        device's), then every chunk all-gathered."""
        bucket, view = self.buckets[i], self.views[i]
        lo, hi, at = self.shards.pieces[i]
        if hi > lo:
            mine, into = self.owned[at:at + hi - lo], view[lo - bucket.lo:hi - bucket.lo]
            on = {} if stream is None else {"stream": stream}
            if self._narrowed:   # the masters rounded to the compute dtype (elementwise: as rounding them whole)
                self.device.ops.narrow(mine, into, **on)
            else:
                self.device.ops.residual_backward(mine, into, None, False, **on)
        if stream is not None:
            stream.synchronize()   # the chunk in place before the staging reads the slot
        # a gather moves numbers: 16-bit values as their bits (MPI has no bf16 or fp16 type of its own)
        self.gatherer.allgather(view.view(np.uint16) if self._narrowed else view)

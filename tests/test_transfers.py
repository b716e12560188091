"""Host <-> GPU copies and their order against the device's stream (hpctrain/device/transfers.py).

numba's simulator runs every copy at once and its events and streams wait for nothing, so a
missing wait could not fail there. These tests drive the classes with a recording stand-in for
numba.cuda instead: which stream each wait and copy is queued on, and what the host waits for.
The stream ordering itself runs on a GPU (scripts/cuda-tests.txt: the 2-rank GPT runs that
compare against 1 rank with the communication thread on).
"""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from hpctrain.comm.buckets import Bucket, BucketedAllreduce
from hpctrain.comm.staging import Staging
from hpctrain.device.transfers import PinnedUpload, StreamFence


class Log(list):
    pass


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(("host waits for stream", self.name))


class FakeEvent:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))

    def wait(self, stream):
        self.log.append(("stream waits for event", stream.name, self.name))

    def synchronize(self):
        self.log.append(("host waits for event", self.name))


def fake_cuda(log):
    streams, events = iter(range(100)), iter(range(100))
    return types.SimpleNamespace(stream=lambda: FakeStream(log, f"own{next(streams)}"),
                                 event=lambda **kw: FakeEvent(log, f"e{next(events)}"),
                                 pinned_array=lambda shape, dtype: np.zeros(shape, dtype))


def recording_buffer(log):
    """An ndarray subclass standing in for a device array: its copies to and from the host are
    appended to ``log`` as ("to host" | "to device", the stream's name)."""
    class Buf(np.ndarray):
        def copy_to_host(self, host, stream):
            log.append(("to host", stream.name))
            host[...] = self

        def copy_to_device(self, host, stream):
            log.append(("to device", stream.name))
            self[...] = host
    return Buf


def _fence():
    log = Log()
    return StreamFence(fake_cuda(log), FakeStream(log, "device")), log


def test_outside_a_fence_everything_waits_for_the_whole_stream():
    fence, log = _fence()
    fence.wait_for_writes()
    assert fence.transfer_stream() is fence.stream
    fence.transfer_done(fence.stream)
    assert log == [("host waits for stream", "device")]


def test_inside_a_fence_the_first_wait_is_for_the_event_and_copies_go_on_the_threads_own_stream():
    fence, log = _fence()
    ready = FakeEvent(log, "bucket ready")
    with fence.fenced(ready):
        fence.wait_for_writes()                 # the bucket's gradients: its event only
        own = fence.transfer_stream()
        assert own is not fence.stream
        fence.transfer_done(own)                # a copy back: the device's stream waits for it
        fence.wait_for_writes()                 # later: anything queued since (a strategy's kernel)
        assert fence.transfer_stream() is own   # one stream per thread, kept
    assert fence.transfer_stream() is fence.stream
    assert log == [("host waits for event", "bucket ready"), ("record", "e0", own.name),
                   ("stream waits for event", "device", "e0"), ("host waits for stream", "device")]


def test_a_fence_holds_in_its_own_thread_only():
    fence, log = _fence()
    inside, seen = threading.Event(), []

    def other():
        inside.wait(10)
        seen.append(fence.transfer_stream() is fence.stream)
        fence.wait_for_writes()
    with fence.fenced(FakeEvent(log, "ready")):
        thread = threading.Thread(target=other)
        thread.start()
        inside.set()
        thread.join(10)
    assert seen == [True] and log == [("host waits for stream", "device")]


def test_staging_copies_a_fenced_bucket_on_the_threads_stream():
    """Staging in pinned mode, inside a fence: waits for the bucket's event, copies out and back
    on the thread's stream, and the device's stream waits for the copy back."""
    fence, log = _fence()
    copies = []
    Buf = recording_buffer(copies)
    dev = types.SimpleNamespace(name="cuda", fence=fence)
    staging = Staging(dev, "off")
    staging._pinned_for = lambda buf, slot: np.zeros(buf.shape, buf.dtype)
    buf = np.arange(4.0).view(Buf)
    with fence.fenced(FakeEvent(log, "ready")):
        with staging.mpi_view(buf) as host:
            host *= 2
    own = copies[0][1]
    assert copies == [("to host", own), ("to device", own)] and own != "device"
    assert log[0] == ("host waits for event", "ready") and log[-1] == ("stream waits for event", "device", "e0")
    np.testing.assert_array_equal(buf, [0, 2, 4, 6])


def test_the_communication_thread_reduces_each_bucket_fenced_by_its_ready_event():
    """mark_ready records the bucket's event on the device's stream as its last gradient is queued;
    the thread reduces it inside fenced(that event)."""
    log, fenced = Log(), []

    class Fence:
        def __init__(self):
            self.n = 0

        def new_event(self):
            self.n += 1
            return f"e{self.n - 1}"

        def record(self, event):
            log.append(("record", event))

        def fenced(self, event):
            import contextlib

            @contextlib.contextmanager
            def block():
                fenced.append(event)
                yield
                fenced.append(None)
            return block()

    def strategy(view, op):
        log.append(("reduce", int(view[0]), fenced[-1]))
    grad = np.array([100.0, 100.0, 0.0, 0.0])
    buckets = [Bucket(0, 0, 2, ("a",)), Bucket(1, 2, 4, ("b",))]
    ops = types.SimpleNamespace(scale=lambda v, s: v.__imul__(s))
    comm = BucketedAllreduce(strategy, grad, buckets, types.SimpleNamespace(ops=ops, fence=Fence()))
    comm._may_inline = False   # both buckets on the thread
    comm.start(scale=1.0)
    comm.mark_ready("a")
    comm.wait(buckets[0])
    comm.mark_ready("b")
    comm.wait(buckets[1])
    assert log == [("record", "e0"), ("reduce", 100, "e0"), ("record", "e1"), ("reduce", 0, "e1")]


def test_pinned_uploads_take_two_buffers_in_turn_and_wait_for_the_copy_two_uploads_ago():
    log = Log()
    cuda = fake_cuda(log)
    sent = []

    class Buf(np.ndarray):
        def copy_to_device(self, host, stream):
            sent.append(id(host))
            self[...] = host
    up = PinnedUpload(cuda, np.zeros(3).view(Buf))
    stream = FakeStream(log, "device")
    for k in range(3):
        out = up.send(np.full(3, k), stream)
        assert out is up.buf and np.all(out == k)
    assert sent[0] == sent[2] != sent[1]   # the pinned buffers alternate
    # each buffer's event is waited on before it is written, recorded after its copy
    assert log == [("host waits for event", "e0"), ("record", "e0", "device"),
                   ("host waits for event", "e1"), ("record", "e1", "device"),
                   ("host waits for event", "e0"), ("record", "e0", "device")]


@pytest.mark.parametrize("pool", ["float64", "uint16"])
def test_a_zero_3_gather_waits_for_its_slots_event_and_copies_on_the_threads_stream(pool):
    """ZeRO-3 on a GPU: queuing a gather records an event on the device's stream, on the main thread,
    after the kernels queued so far (the slot's last readers, the masters' update); the gather thread
    waits for that event only, copies (float64 pool) or rounds (a 16-bit pool, bf16's uint16) its
    chunk into the slot and stages the slot on its own stream, and the device's stream waits for the
    copy back. Never a wait for the device's whole stream on the gather thread."""
    from hpctrain.comm.zero import ZeroShards
    from hpctrain.comm.zero_params import ParameterSlots
    from hpctrain.nn.flat import FlatParams

    fence, log = _fence()
    threads = set()
    Buf = recording_buffer(log)

    def copy(src, dst, db=None, accumulate=False, stream=None):   # the chunk into its slot (copy or narrow)
        log.append(("chunk copy", stream.name if stream is not None else "device"))
        threads.add(threading.current_thread().name)
        dst[...] = src

    recorded_on = []
    record = fence.record

    def record_where(event):
        recorded_on.append(threading.current_thread().name)
        return record(event)
    fence.record = record_where
    dev = types.SimpleNamespace(name="cuda", fence=fence, dtype=np.dtype(np.float64),
                                zeros=lambda n, dtype=None: np.zeros(n, dtype or np.float64).view(Buf),
                                ops=types.SimpleNamespace(residual_backward=copy, narrow=copy),
                                synchronize=lambda: log.append(("host waits for stream", "device")))
    flat = FlatParams(dev, [("a", (4,)), ("b", (4,))], allocate=False)
    buckets = [Bucket(0, 4, 8, ("b",)), Bucket(1, 0, 4, ("a",))]
    shards = ZeroShards(buckets, 0, 2, lambda rank, size: rank)   # this rank: the first half of each
    slots = ParameterSlots(buckets, shards, flat, [("a",), ("b",)], dev, overlap=True, dtype=np.dtype(pool))
    slots.owned[:] = [1.0, 2.0, 3.0, 4.0]   # bucket 0's chunk, then bucket 1's

    class Gatherer:
        staging = Staging(dev, "off")

        def allgather(self, buf):   # the other rank's half arrives on the host (a 16-bit pool: as its bits)
            assert buf.dtype == np.dtype(pool if pool == "float64" else np.uint16)
            with self.staging.host_view(buf, slot="zero") as host:
                host[host.size // 2:] = 9
    Gatherer.staging._pinned_for = lambda buf, slot: np.zeros(buf.shape, buf.dtype)
    slots.connect(Gatherer())
    log.append(("kernel", "device"))   # a kernel queued before the fetch (the slot's last reader, say)
    try:
        slots.fetch(("b",), forward=True)
    finally:
        slots.close()
    record = log.index(("record", "e0", "device"))   # the slot's event, recorded as the gather was queued
    assert log.index(("kernel", "device")) < record and recorded_on == ["MainThread"]
    after = log[record + 1:]
    own = next(entry[1] for entry in after if entry[0] == "chunk copy")
    assert own not in ("device",) and threads == {"hpctrain-zero3-gather"}
    assert after.index(("host waits for event", "e0")) < after.index(("chunk copy", own)) \
        < after.index(("to host", own)) < after.index(("to device", own))
    assert after[-1] == ("stream waits for event", "device", "e1")   # the device's stream waits for the copy back
    assert ("host waits for stream", "device") not in after
    np.testing.assert_array_equal(slots.views[0], [1, 2, 9, 9])

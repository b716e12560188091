"""Copies between host and GPU memory, and their order against the device's stream.

:class:`PinnedUpload` fills one device buffer from pinned host memory, asynchronously: the
host does not wait for the GPU to take a batch or a step's optimizer scalars.

:class:`StreamFence` lets the communication thread copy a gradient bucket out while backward's
later kernels are still queued. Waiting for the whole stream first (``synchronize``) would wait
for them too, and backward and the all-reduce would not overlap. Instead the main thread records
an event on the stream when the bucket's last gradient is queued; the communication thread, in
``fenced(event)``, waits for that event only, and copies on a stream of its own, so its copies
do not queue behind backward either; a copy back into device memory makes the device's stream
wait for it (the GPU waits, not the host). :class:`HostFence` is the CPU's: nothing is queued.
"""

from __future__ import annotations

import contextlib
import threading


def _untimed_event(cuda):
    """A CUDA event without timing (cheaper to record and wait on); the simulator's takes no arguments."""
    from ..kernels.support.cuda_support import simulated

    return cuda.event() if simulated() else cuda.event(timing=False)


class PinnedUpload:
    """A device buffer and the two pinned host buffers that fill it in turn, each with the event
    recorded after its last copy (the host may not write a pinned buffer a copy still reads)."""

    def __init__(self, cuda, buf):
        self.buf = buf
        self.pinned = [cuda.pinned_array(buf.shape, dtype=buf.dtype) for _ in range(2)]
        self.copied = [_untimed_event(cuda) for _ in range(2)]
        self.turn = 0

    def send(self, host, stream):
        """``host`` (same shape and dtype) into the buffer, queued on ``stream``; returns the buffer."""
        i, self.turn = self.turn, 1 - self.turn
        self.copied[i].synchronize()   # at once, unless its copy of two uploads ago is still queued
        self.pinned[i][...] = host
        self.buf.copy_to_device(self.pinned[i], stream=stream)
        self.copied[i].record(stream)
        return self.buf


class StreamFence:
    """Orders one thread's host reads and copies of device memory against the device's ``stream``
    (module doc). Outside :meth:`fenced` every method behaves as the plain stream would."""

    def __init__(self, cuda, stream):
        self._cuda, self.stream = cuda, stream
        self._thread = threading.local()   # per thread: the pending fence event, the own stream

    def new_event(self):
        return _untimed_event(self._cuda)

    def record(self, event):
        """``event`` recorded on the device's stream, after everything queued so far; returns it."""
        event.record(self.stream)
        return event

    @contextlib.contextmanager
    def fenced(self, event):
        """In this thread, until the block ends: the first :meth:`wait_for_writes` waits for
        ``event`` only (later ones for the whole stream: work this thread queued on it since, such
        as a strategy's kernel, is behind backward's), and copies go on this thread's own stream
        (:meth:`transfer_stream`). ``event`` must follow every write that the block's reads need
        (the bucket's last gradient); None: no fence."""
        if event is None:
            yield
            return
        local = self._thread
        if getattr(local, "stream", None) is None:
            local.stream = self._cuda.stream()
        local.fence, local.fenced = event, True
        try:
            yield
        finally:
            local.fence, local.fenced = None, False

    def wait_for_writes(self) -> None:
        """Returns once the device memory the host (or MPI) is about to read is written: after the
        fence event, the first time inside :meth:`fenced`; else after every queued kernel."""
        local = self._thread
        event = getattr(local, "fence", None)
        if event is None:
            self.stream.synchronize()
        else:
            local.fence = None
            event.synchronize()

    def transfer_stream(self):
        """The stream for this thread's copies between device and host: its own inside
        :meth:`fenced`, else the device's."""
        local = self._thread
        return local.stream if getattr(local, "fenced", False) else self.stream

    def transfer_done(self, stream) -> None:
        """After a copy into device memory queued on ``stream`` (from :meth:`transfer_stream`): the
        device's stream waits for it before its next kernel."""
        if stream is not self.stream:
            local = self._thread
            if getattr(local, "copied", None) is None:
                local.copied = _untimed_event(self._cuda)
            local.copied.record(stream)   # re-recording is safe: the wait below took its state
            local.copied.wait(self.stream)


class HostFence:
    """The CPU's :class:`StreamFence`: host memory, nothing queued, so nothing to wait for."""

    def new_event(self):
        return None

    def record(self, event):
        return event

    def fenced(self, event):
        return contextlib.nullcontext()

    def wait_for_writes(self) -> None:
        pass

    def transfer_stream(self):
        return None

    def transfer_done(self, stream) -> None:
        pass

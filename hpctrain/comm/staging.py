"""The one place that decides how a device buffer reaches MPI (docs/gpu.md, "MPI staging").

Three modes, chosen once per device by :func:`staging_mode`:

  host    CPU arrays: MPI reads and writes them as they are.
  device  a CUDA-aware MPI: device arrays go to MPI directly (``__cuda_array_interface__``).
  pinned  any other MPI with a GPU: MPI works on a pinned host copy (one per buffer, reused).

MPI never reads a buffer a kernel is still writing: every view first waits for the device's
writes (``device.fence.wait_for_writes()``: the whole stream; the first wait inside
``device.fence.fenced(event)``, on the communication thread, only for the bucket's event), and
pinned copies go on ``device.fence.transfer_stream()``. Strategies that reduce on the
host (ring, rhd) use :meth:`Staging.host_view`: the buffer itself on the CPU, a pinned copy of a
CUDA buffer in every mode.
"""

from __future__ import annotations

import ctypes


def cuda_aware_mpi() -> tuple[bool, str]:
    """(is the MPI library CUDA-aware, how we know). Needs MPI initialised.

    Open MPI answers ``MPIX_Query_cuda_support()`` (its mpi-ext.h); MPICH
    derivatives ``MPIX_GPU_query_support``. Debian's Open MPI 4.1.4 answers 0.
    """
    from mpi4py import MPI  # noqa: F401 - loads libmpi into the process

    for lib in _libmpi_handles():
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query()), "MPIX_Query_cuda_support()"
        query = getattr(lib, "MPIX_GPU_query_support", None)
        if query is not None:
            flag = ctypes.c_int(0)
            query(ctypes.c_int(0), ctypes.byref(flag))  # MPIX_GPU_SUPPORT_CUDA = 0 in MPICH's mpi.h
            return bool(flag.value), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)"
    return False, "the MPI library offers no CUDA-support query"


def _libmpi_handles():
    """The process's global symbols, then every loaded libmpi* by path: mpi4py may
    load libmpi RTLD_LOCAL, hiding its symbols from CDLL(None); opening the same
    path again returns the already-loaded library."""
    yield ctypes.CDLL(None)
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "/libmpi" in line}
    except OSError:
        return
    for path in sorted(paths):
        try:
            yield ctypes.CDLL(path)
        except OSError:
            continue


def staging_mode(device, setting: str = "auto") -> str:
    """'host', 'device' or 'pinned' for ``device`` under dist.cuda_aware_mpi = auto | on | off."""
    if device.name == "cpu":
        return "host"
    if setting == "on":
        return "device"
    if setting == "off":
        return "pinned"
    from ..kernels.support.cuda_support import simulated

    if simulated():
        # simulator arrays only pretend to be device memory; use the real path
        return "pinned"
    return "device" if cuda_aware_mpi()[0] else "pinned"


class Staging:
    """``with staging.mpi_view(buf) as mpi_buf: <MPI call>`` - results land in ``buf``.

    ``with staging.host_view(buf) as host: <host arithmetic and MPI calls>`` - the same,
    but ``host`` is always host memory.
    """

    def __init__(self, device, setting: str = "auto"):
        self.device = device
        self.mode = staging_mode(device, setting)
        self._pinned: dict = {}
        self._landed: dict = {}   # pinned buffer key -> the event after the copy out of it (post_recv)
        self._events: dict = {}   # pinned buffer key -> that event, made once and reused

    def mpi_view(self, buf, slot=None):
        """A context manager yielding what to hand MPI for ``buf``.

        In pinned mode the host buffer is shared by every call with the same
        (slot, shape, dtype): it is scratch, filled on entry. Buffers staged at
        the same time (e.g. buckets in flight together) need different slots.
        """
        self.device.fence.wait_for_writes()  # every kernel that wrote buf has finished
        if self.mode == "pinned":
            return _PinnedCopy(self.device, self._pinned_for(buf, slot), buf)
        return _Direct(buf)

    def send_view(self, buf, slot=None):
        """As :meth:`mpi_view` for a buffer MPI only reads (a send): nothing is copied back. A
        non-blocking send from a pinned copy must complete before the next view of the same slot."""
        self.device.fence.wait_for_writes()
        if self.mode == "pinned":
            return _PinnedCopy(self.device, self._pinned_for(buf, slot), buf, copy_in=True, copy_back=False)
        return _Direct(buf)

    def recv_view(self, buf, slot=None):
        """As :meth:`mpi_view` for a buffer MPI only writes (a blocking receive): nothing is copied in."""
        self.device.fence.wait_for_writes()   # nothing still reads or writes buf when MPI fills it
        if self.mode == "pinned":
            return _PinnedCopy(self.device, self._pinned_for(buf, slot), buf, copy_in=False, copy_back=True)
        return _Direct(buf)

    def post_recv(self, buf, start, slot=None) -> "PostedRecv":
        """A non-blocking receive into ``buf``: ``start(view)`` posts it on what MPI is to fill and
        returns the MPI request; :meth:`PostedRecv.wait` completes it with the data in ``buf``. Nothing
        may read or write ``buf`` in between. Host mode hands MPI ``buf`` itself; device mode too,
        after the device's queued work (a kernel may still read ``buf``); pinned mode hands it the
        pinned buffer of ``slot`` (receives in flight together need different slots), once the copy
        out of it that the last receive there queued is done, and ``wait`` copies it into ``buf``
        (queued on the device's stream, behind whatever still reads ``buf``)."""
        if self.mode == "pinned":
            host = self._pinned_for(buf, slot)
            key = (slot, tuple(buf.shape), buf.dtype.str)
            copied = self._landed.pop(key, None)
            if copied is not None:
                copied.synchronize()

            event = self._events.get(key) or self._events.setdefault(key, self.device.fence.new_event())

            def landed():   # the copy out of the pinned buffer is queued: the next receive there waits for it
                self._landed[key] = self.device.fence.record(event)

            return PostedRecv(start(host), _PinnedCopy(self.device, host, buf, copy_in=False), landed)
        self.device.fence.wait_for_writes()
        return PostedRecv(start(buf), None)

    def host_view(self, buf, slot=None):
        """A context manager yielding ``buf`` in host memory, for host arithmetic and MPI.

        CPU buffers are yielded as they are; CUDA buffers are copied into the
        pinned host buffer for (slot, shape, dtype) - the one mpi_view uses in
        pinned mode - whatever the mode, and copied back on a clean exit.
        """
        self.device.fence.wait_for_writes()  # every kernel that wrote buf has finished
        if self.mode == "host":
            return _Direct(buf)
        return _PinnedCopy(self.device, self._pinned_for(buf, slot), buf)

    def _pinned_for(self, buf, slot):
        """The pinned host buffer for (slot, shape, dtype), allocated on first use and reused."""
        key = (slot, tuple(buf.shape), buf.dtype.str)
        host = self._pinned.get(key)
        if host is None:
            from numba import cuda

            host = self._pinned[key] = cuda.pinned_array(buf.shape, dtype=buf.dtype)
        return host


class PostedRecv:
    """A receive posted by :meth:`Staging.post_recv`: ``wait()`` completes it (the data in its buffer)."""

    def __init__(self, request, copy_back, landed=None):
        self.request, self._copy_back, self._landed = request, copy_back, landed

    def test(self) -> bool:
        """Whether the message has arrived (and MPI progressed); the data lands at :meth:`wait`."""
        return self.request.Test()

    def wait(self) -> None:
        self.request.Wait()
        if self._copy_back is not None:   # the pinned buffer into the device's, queued on its stream
            self._copy_back.__exit__(None)
            self._landed()


class _Direct:
    """The buffer itself (host memory, or device memory for a CUDA-aware MPI)."""

    def __init__(self, buf):
        self.buf = buf

    def __enter__(self):
        return self.buf

    def __exit__(self, *exc):
        return False


class _PinnedCopy:
    """Device -> pinned host on entry; pinned host -> device on a clean exit, both on the fence's
    transfer stream (the device's stream waits for the copy back before its next kernel)."""

    def __init__(self, device, host, buf, copy_in=True, copy_back=True):
        self.device, self.host, self.buf = device, host, buf
        self.copy_in, self.copy_back = copy_in, copy_back
        self.stream = device.fence.transfer_stream()

    def __enter__(self):
        if self.copy_in:
            self.buf.copy_to_host(self.host, stream=self.stream)
            self.stream.synchronize()  # the host copy is complete before MPI reads it
        return self.host

    def __exit__(self, exc_type, *exc):
        if exc_type is None and self.copy_back:
            self.buf.copy_to_device(self.host, stream=self.stream)
            self.device.fence.transfer_done(self.stream)
        return False

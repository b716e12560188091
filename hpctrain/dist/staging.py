"""The one place that decides how a device buffer reaches MPI.

CPU buffers go to MPI as they are. The CUDA device (issue 3) decides here
between handing device pointers to a CUDA-aware MPI and copying through pinned
host buffers that are allocated once and reused; either way the device is
synchronised before any MPI call.
"""


class Staging:
    """``with staging.mpi_view(buf) as host: <MPI call on host>`` - results land in ``buf``."""

    def __init__(self, device):
        self.device = device

    def mpi_view(self, buf):
        self.device.synchronize()  # every kernel that wrote buf has finished
        return _Direct(buf)


class _Direct:
    """The buffer itself: host memory MPI can read and write."""

    def __init__(self, buf):
        self.buf = buf

    def __enter__(self):
        return self.buf

    def __exit__(self, *exc):
        return False

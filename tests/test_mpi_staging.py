"""The host-staging path under MPI (mpirun -n 1..4): device buffers reach MPI
through pinned host copies, and the all-reduce strategies give the closed-form
answer. Without a GPU the device is numba's simulator, whose arrays mpi4py would
accept directly; the staging mode is forced to the pinned path, and the test
checks that MPI is handed plain host arrays.
"""

import dataclasses

import numpy as np
import pytest

from hpctrain.device import CudaDevice, cuda_status
from hpctrain.comm import STRATEGIES
from hpctrain.comm.staging import Staging

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240),
              pytest.mark.skipif(cuda_status()[0] == 0, reason="numba.cuda unusable")]


class RecordingComm:
    """A communicator that records the type of every buffer handed to MPI."""

    def __init__(self, comm):
        self._comm, self.seen = comm, []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name in ("Allreduce", "Iallreduce", "Reduce", "Bcast", "Sendrecv", "Send", "Recv", "Isend", "Irecv",
                    "Reduce_scatter", "Allgather", "Allgatherv"):
            def call(*args, **kw):
                self.seen += [type(a).__name__ for a in args if hasattr(a, "shape")]
                return attr(*args, **kw)
            return call
        return attr


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_staged_allreduce_mean_of_rank_values(strategy, dtype):
    from hpctrain.runtime import init_world

    world = init_world(ranks_per_node=2)   # two simulated nodes from 3 ranks up: hierarchical crosses them
    comm = RecordingComm(world.comm)
    seen = comm.seen
    local, cross = RecordingComm(world.local_comm), RecordingComm(world.cross_comm)
    local.seen = cross.seen = seen
    world = dataclasses.replace(world, comm=comm, local_comm=local, cross_comm=cross)
    dev = CudaDevice(dtype)
    staging = Staging(dev, "off")
    allreduce = STRATEGIES[strategy](world, dev, staging)
    n = 37
    buf = dev.from_host(np.full(n, world.rank, dtype=dtype) + np.arange(n))
    for _ in range(2):  # the second call reuses the pinned buffer
        allreduce(buf, "sum")
    # two sums: first sum(rank + i) = size(size-1)/2 + size*i, then size times that
    size = world.size
    expected = size * (size * (size - 1) / 2 + size * np.arange(n))
    np.testing.assert_allclose(dev.to_host(buf), expected, rtol=1e-6 if dtype == "float32" else 1e-15)
    allreduce(buf, "mean")  # mean of identical values leaves them unchanged
    np.testing.assert_allclose(dev.to_host(buf), expected, rtol=1e-6 if dtype == "float32" else 1e-15)
    # ring, rhd and shm do nothing at all in a 1-rank world: no communication, no copies
    idle = world.size == 1 and strategy in ("ring", "rhd", "shm")
    assert set(seen) <= {"ndarray"}, seen       # MPI only ever saw host arrays
    assert seen or idle, seen
    assert len(staging._pinned) == (0 if idle else 1)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_staged_sum_scaled_of_a_device_buffer(strategy):
    """The gradient buckets' one call (sum, scale, finiteness) on a device buffer: the sum
    travels through the staging copies, the scale and the test run on the device; a NaN
    on the last rank is reported by some rank."""
    from hpctrain.comm.reduce_ops import sum_scaled
    from hpctrain.runtime import init_world

    world = init_world(ranks_per_node=2)
    dev = CudaDevice("float32")
    allreduce = STRATEGIES[strategy](world, dev, Staging(dev, "off"))
    n, size = 37, world.size
    buf = dev.from_host(np.full(n, world.rank, dtype="float32") + np.arange(n, dtype="float32"))
    assert sum_scaled(allreduce, buf, 1.0 / size, dev, check_finite=True)
    np.testing.assert_allclose(dev.to_host(buf), (size - 1) / 2 + np.arange(n), rtol=1e-6)
    host = np.ones(n, np.float32)
    if world.rank == size - 1:
        host[n // 2] = np.nan
    buf = dev.from_host(host)
    assert not all(world.comm.allgather(sum_scaled(allreduce, buf, 0.5, dev, check_finite=True)))

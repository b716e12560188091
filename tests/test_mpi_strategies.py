"""Flat all-reduce strategies (mpi, naive, ring, rhd), their ops, and the collectives API.

Run under ``mpirun -n 1..4 python -m pytest --with-mpi -m mpi`` (every rank runs
every test). CPU buffers throughout, plus ring and rhd on numba's CUDA
simulator to exercise ``Staging.host_view``.
"""

import dataclasses
import hashlib

import numpy as np
import pytest

from hpctrain.device import CpuDevice, CudaDevice, cuda_status
from hpctrain.comm import STRATEGIES, make_allreduce
from hpctrain.comm.collectives import Collectives
from hpctrain.comm.reduce_ops import reduce_into
from hpctrain.comm.staging import Staging

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

NAMES = ["mpi", "naive", "ring", "rhd", "shm"]
# hierarchical on simulated nodes of 2 ranks (3 ranks: nodes of 2 + 1), with
# its cross-node phase done by each flat strategy in turn
HIER = ["hierarchical/mpi", "hierarchical/ring", "hierarchical/rhd"]
OPS = ["sum", "mean", "max", "min"]


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.fixture(scope="module")
def node_world():
    from hpctrain.runtime import init_world

    return init_world(ranks_per_node=2)


def build(name, world, node_world, device):
    if name == "shm":  # 64 KB segments: buffers of 2^20 + 3 elements take many (tests/test_mpi_shm.py: zero copy)
        from hpctrain.comm.shm import ShmAllreduce

        return ShmAllreduce(world, device, segment_bytes=64 << 10)
    if name.startswith("hierarchical/"):
        return make_allreduce("hierarchical", node_world, device, inner=name.split("/")[1])
    return make_allreduce(name, world, device)


def closed_form(op, size, n):
    """The all-reduce of x = rank + index over ``size`` ranks, in float64."""
    i = np.arange(n, dtype=np.float64)
    total = size * i + size * (size - 1) / 2
    return {"sum": total, "mean": total / size, "max": size - 1 + i, "min": i}[op]


def assert_same_on_every_rank(comm, buf):
    """Every rank holds the same bytes (a hash of them, gathered)."""
    digests = comm.allgather(hashlib.sha256(np.ascontiguousarray(buf).tobytes()).hexdigest())
    assert len(set(digests)) == 1, digests


def test_strategies_are_registered():
    assert set(NAMES) <= set(STRATEGIES)


@pytest.mark.parametrize("name", NAMES + HIER)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [0, 3, 1001])  # 3 < size 4: ring and rhd get empty chunks
def test_rank_plus_index_has_closed_form_results(world, node_world, name, dtype, n):
    allreduce = build(name, world, node_world, CpuDevice(dtype))
    for op in OPS:
        buf = (world.rank + np.arange(n)).astype(dtype)
        assert allreduce(buf, op) is buf
        expected = closed_form(op, world.size, n)
        if op == "mean":
            # the sum is exact; scaling by the rounded 1/size costs up to two roundings
            np.testing.assert_allclose(buf, expected, rtol=2 * np.finfo(dtype).eps, err_msg=op)
        else:
            # integers below 2^24 add exactly in float32 in any order
            np.testing.assert_array_equal(buf, expected.astype(dtype), err_msg=op)


@pytest.mark.parametrize("name", ["mpi", "ring", "rhd", "shm"] + HIER)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1023, 2**20 + 3])
def test_random_data_agrees_with_naive(world, node_world, name, dtype, n):
    from mpi4py import MPI

    comm, size = world.comm, world.size
    x = np.random.default_rng(1000 + world.rank).standard_normal(n).astype(dtype)
    device = CpuDevice(dtype)
    oracle, allreduce = make_allreduce("naive", world, device), build(name, world, node_world, device)
    # Tolerance: added in any order, a sum of size terms is within (size-1)*u*S of
    # the exact sum (u = eps/2, S = sum of |x| over ranks), so two orders differ
    # by at most (size-1)*eps*S; size*eps*S leaves room for second-order terms.
    # A flat rtol would fail where the sum cancels to nearly zero.
    abs_sum = np.empty(n)
    comm.Allreduce(np.abs(x).astype(np.float64), abs_sum, op=MPI.SUM)
    eps = float(np.finfo(dtype).eps)
    for op in OPS:
        got, ref = allreduce(x.copy(), op), oracle(x.copy(), op)
        if op in ("max", "min"):
            np.testing.assert_array_equal(got, ref, err_msg=op)  # exact in any order
        else:
            tol = size * eps * abs_sum
            if op == "mean":  # each side then rounds 1/size and the product once more
                tol = tol / size + 2 * eps * np.abs(ref.astype(np.float64))
            err = np.abs(got.astype(np.float64) - ref)
            assert np.all(err <= tol), f"{op}: max error {err.max()} above tolerance"
        assert_same_on_every_rank(comm, got)


@pytest.mark.parametrize("inner", ["mpi", "ring"])  # mpi: nonblocking cross-node phase; ring: blocking
@pytest.mark.parametrize("n", [5, 1001])
def test_hierarchical_in_tiny_segments_has_closed_form_results(world, node_world, inner, n):
    """Segments of 3 elements: many segments, most chunks of 0 or 1 element, several in flight."""
    from hpctrain.comm.hierarchical import HierarchicalAllreduce

    allreduce = HierarchicalAllreduce(node_world, CpuDevice("float32"), inner=inner, segment_bytes=12)
    for op in OPS:
        buf = (world.rank + np.arange(n)).astype(np.float32)
        allreduce(buf, op)
        expected = closed_form(op, world.size, n)
        if op == "mean":
            np.testing.assert_allclose(buf, expected, rtol=2 * np.finfo(np.float32).eps, err_msg=op)
        else:
            np.testing.assert_array_equal(buf, expected.astype(np.float32), err_msg=op)
        assert_same_on_every_rank(world.comm, buf)


def test_unknown_op_fails_before_any_communication(world, node_world):
    for name in NAMES + HIER:
        with pytest.raises(ValueError, match="prod"):
            build(name, world, node_world, CpuDevice())(np.ones(3, np.float32), "prod")


def test_reduce_into_ops_and_nan():
    dst = np.array([1.0, 5.0, np.nan, 2.0], np.float32)
    src = np.array([3.0, 4.0, 1.0, np.nan], np.float32)
    np.testing.assert_array_equal(reduce_into(dst.copy(), src, "sum"), [4, 9, np.nan, np.nan])
    # NaN on either side wins, as numpy.maximum / numpy.minimum
    np.testing.assert_array_equal(reduce_into(dst.copy(), src, "max"), np.maximum(dst, src))
    np.testing.assert_array_equal(reduce_into(dst.copy(), src, "min"), np.minimum(dst, src))
    with pytest.raises(ValueError):
        reduce_into(dst, src.astype(np.float64), "sum")


# ---- ring and rhd on CUDA buffers: host arithmetic through host_view ------------------
class RecordingComm:
    """Forwards to a communicator; records the type of every buffer given to point-to-point calls."""

    def __init__(self, comm):
        self._comm, self.seen = comm, []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in ("Sendrecv", "Send", "Recv"):
            return attr

        def call(*args, **kw):
            self.seen += [type(a).__name__ for a in args if hasattr(a, "shape")]
            return attr(*args, **kw)
        return call


@pytest.mark.skipif(cuda_status()[0] == 0, reason="numba.cuda unusable")
@pytest.mark.parametrize("name", ["ring", "rhd"])
@pytest.mark.parametrize("setting", ["on", "off"])  # on: MPI would take device arrays
def test_cuda_buffers_are_reduced_in_host_memory(world, name, setting):
    comm = RecordingComm(world.comm)
    device = CudaDevice("float64")
    staging = Staging(device, setting)
    allreduce = STRATEGIES[name](dataclasses.replace(world, comm=comm), device, staging)
    n = 11
    for op in OPS:
        buf = device.from_host(world.rank + np.arange(n, dtype=np.float64))
        allreduce(buf, op)
        np.testing.assert_allclose(device.to_host(buf), closed_form(op, world.size, n), rtol=1e-15)
    assert set(comm.seen) <= {"ndarray"}, comm.seen  # pinned host arrays, never device arrays
    assert comm.seen or world.size == 1


# ---- the collectives API ---------------------------------------------------------------
@pytest.fixture(scope="module")
def coll(world):
    return Collectives(world, CpuDevice("float64"))


def test_bcast_from_the_last_rank(world, coll):
    root = world.size - 1
    buf = np.arange(5.0) if world.rank == root else np.zeros(5)
    assert coll.Bcast(buf, root=root) is buf
    np.testing.assert_array_equal(buf, np.arange(5.0))
    coll.Bcast(np.zeros(0), root=root)  # empty: no hang


def test_allgather_and_allgatherv_with_uneven_counts(world, coll):
    size, rank = world.size, world.rank
    out = coll.Allgather(np.full(3, float(rank)), np.empty(3 * size))
    np.testing.assert_array_equal(out, np.repeat(np.arange(size), 3))
    counts = [[2, 0, 3, 1][i % 4] for i in range(size)]  # rank 1 sends nothing
    out = coll.Allgatherv(np.full(counts[rank], float(rank)), np.empty(sum(counts)), counts)
    np.testing.assert_array_equal(out, np.repeat(np.arange(size), counts))
    with pytest.raises(ValueError, match="counts"):  # every rank raises, before MPI
        coll.Allgatherv(np.zeros(counts[rank]), np.empty(sum(counts)), counts + [1])


@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter_with_uneven_counts(world, coll, op):
    size, rank = world.size, world.rank
    counts = [[3, 0, 2, 1][i % 4] for i in range(size)]  # rank 1 receives nothing
    total = sum(counts)
    recv = coll.Reduce_scatter(rank + np.arange(total, dtype=np.float64), np.empty(counts[rank]), counts, op)
    start = sum(counts[:rank])
    np.testing.assert_allclose(recv, closed_form(op, size, total)[start:start + counts[rank]], rtol=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_split_by_rank_parity(world, coll, name):
    rank = world.rank
    members = [r for r in range(world.size) if r % 2 == rank % 2]
    sub = Collectives(world, CpuDevice("float64"), allreduce=name).Split(rank % 2)
    assert (sub.size, sub.rank, sub.allreduce_name) == (len(members), members.index(rank), name)
    assert sub.world.n_nodes == 1 and sub.world.local_size == len(members)  # one machine
    np.testing.assert_array_equal(sub.Allreduce(np.full(5, float(rank))), np.full(5, float(sum(members))))
    np.testing.assert_array_equal(sub.Bcast(np.full(2, float(rank))), np.full(2, float(members[0])))
    reversed_sub = coll.Split(rank % 2, key=-rank)  # key orders the new ranks
    assert reversed_sub.rank == len(members) - 1 - members.index(rank)
    sub.Barrier()
    coll.Barrier()

"""Topology: real nodes (shared memory) and simulated nodes (--ranks-per-node)."""

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def test_one_machine_is_one_node():
    from hpctrain.runtime import init_world

    w = init_world()
    assert (w.n_nodes, w.node_rank, w.local_size, w.local_rank) == (1, 0, w.size, w.rank)
    assert w.cross_comm.Get_size() == 1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_simulated_nodes_of_k_ranks(k):
    """Blocks of k consecutive ranks; the last node may be smaller (e.g. 3 ranks as 2 + 1)."""
    from hpctrain.runtime import init_world

    w = init_world(ranks_per_node=k)
    n_nodes = -(-w.size // k)
    assert w.n_nodes == n_nodes
    assert w.node_rank == w.rank // k
    assert w.local_rank == w.rank % k
    assert w.local_size == min(k, w.size - w.node_rank * k)
    # the cross-node communicator links the same local rank on every node that has one
    expected_cross = sum(1 for node in range(n_nodes) if node * k + w.local_rank < w.size)
    assert w.cross_comm.Get_size() == expected_cross
    assert w.local_comm.allreduce(w.node_rank, op=__import__("mpi4py").MPI.MAX) == w.node_rank


def test_agree_raises_everywhere_when_one_rank_fails():
    from hpctrain.errors import DataError, UserError
    from hpctrain.reliability.fail_together import agree
    from hpctrain.runtime import init_world

    w = init_world()
    culprit = w.size - 1

    def check():
        if w.rank == culprit:
            raise DataError("file missing on this node")
        return "ok"

    with pytest.raises(UserError) as info:
        agree(w, check)
    assert "file missing on this node" in str(info.value)
    assert info.value.agreed
    if w.size > 1:
        assert f"on rank {culprit}" in str(info.value)
    assert agree(w, lambda: 42) == 42


def test_the_test_ranks_share_the_cores():
    """tests/conftest.py gives each rank of the MPI test phases its share of the cores, as the CLI
    gives its ranks (3 ranks on 2 cores with a BLAS thread per core each ran 2.5x slower)."""
    import os

    from conftest import CALLER_SET_THREADS
    from mpi4py import MPI

    from hpctrain.runtime import THREAD_VARS

    if CALLER_SET_THREADS:
        pytest.skip("thread counts chosen by the caller: left alone, as the CLI leaves them")
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    size = node.Get_size()
    node.Free()
    if size == 1:
        pytest.skip("one rank on this node: nothing to share")
    share = str(max(1, min(len(os.sched_getaffinity(0)), (os.cpu_count() or 1) // size)))
    assert {var: os.environ.get(var) for var in THREAD_VARS} == {var: share for var in THREAD_VARS}

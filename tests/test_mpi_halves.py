"""ZeRO's halves of every strategy (``reduce_scatter``, ``allgather``, ``owned_chunk``), against the
strategy's own all-reduce, inside one MPI job (run under mpirun -n 1..4).

hierarchical runs on simulated nodes of 1 and 2 ranks (3 ranks as 2 + 1: nodes of unequal size,
where its halves are the whole sum) and on the one real node (its inner strategy's halves).
"""

import numpy as np
import pytest

from hpctrain.comm import make_allreduce
from hpctrain.comm.ring import chunk_offsets
from hpctrain.comm.zero import owned_chunk_rule
from hpctrain.device import CpuDevice

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

CASES = ["mpi", "naive", "ring", "rhd", "shm", "hierarchical/mpi@node", "hierarchical/ring@node",
         "hierarchical/mpi@1", "hierarchical/rhd@1", "hierarchical/mpi@2", "hierarchical/ring@2"]


@pytest.fixture(scope="module")
def worlds():
    from hpctrain.runtime import init_world

    return {"node": init_world(), 1: init_world(ranks_per_node=1), 2: init_world(ranks_per_node=2)}


def _build(case, worlds):
    """(strategy, world, inner) of a case name ``name[/inner][@ranks per node]``."""
    name, _, nodes = case.partition("@")
    name, _, inner = name.partition("/")
    world = worlds["node" if nodes in ("", "node") else int(nodes)]
    return make_allreduce(name, world, CpuDevice("float64"), inner=inner or "mpi"), world, inner or "mpi"


def _expect_native(case, world) -> bool:
    if not case.startswith("hierarchical"):
        return case in ("mpi", "ring", "rhd")
    if world.n_nodes == 1:  # the inner strategy's
        return case.split("/")[1].split("@")[0] in ("mpi", "ring", "rhd")
    sizes = {}
    for node, _ in world.where:
        sizes[node] = sizes.get(node, 0) + 1
    return world.n_nodes > 1 and len(set(sizes.values())) == 1


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n", [0, 2, 1001])  # 2 < 4 ranks: empty chunks
def test_reduce_scatter_leaves_each_rank_its_chunk_of_the_sum(worlds, case, n):
    """Each rank's owned chunk holds the sum over ranks: the same bits as the strategy's all-reduce
    (every strategy but mpi, whose MPI_Reduce_scatter may add in another order than MPI_Allreduce,
    and hierarchical across nodes, whose second half is MPI_Reduce_scatter: to rounding). The owned
    chunks of the ranks are a permutation of the ring's cut, the same as ZeRO's shares assume."""
    strategy, world, inner = _build(case, worlds)
    rng = np.random.default_rng(100 + world.rank)
    x = rng.standard_normal(n)
    whole = strategy(x.copy(), "sum")
    mine = x.copy()
    assert strategy.reduce_scatter(mine) is mine
    owners = [strategy.owned_chunk(r, world.size) for r in range(world.size)]
    assert sorted(owners) == list(range(world.size))
    assert owners == [owned_chunk_rule(case.split("/")[0].split("@")[0], world, inner)(r, world.size)
                      for r in range(world.size)]
    assert strategy.native_halves == _expect_native(case, world)
    off = chunk_offsets(n, world.size)
    c = strategy.owned_chunk(world.rank, world.size)
    got, want = mine[off[c]:off[c + 1]], whole[off[c]:off[c + 1]]
    total = sum(np.random.default_rng(100 + r).standard_normal(n) for r in range(world.size))
    np.testing.assert_allclose(got, total[off[c]:off[c + 1]], rtol=1e-12, atol=1e-12)
    rounding = case == "mpi" or case.startswith("hierarchical") and world.n_nodes > 1 and strategy.native_halves
    if not rounding and case != "hierarchical/mpi@node":
        assert np.array_equal(got, want)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n", [0, 2, 1001])
def test_allgather_gives_every_rank_every_owners_chunk(worlds, case, n):
    strategy, world, _ = _build(case, worlds)
    off = chunk_offsets(n, world.size)
    owner_of = {strategy.owned_chunk(r, world.size): r for r in range(world.size)}
    want = np.concatenate([np.full(off[c + 1] - off[c], float(owner_of[c])) for c in range(world.size)])
    x = np.full(n, -1.0)
    c = strategy.owned_chunk(world.rank, world.size)
    x[off[c]:off[c + 1]] = world.rank
    assert strategy.allgather(x) is x
    assert np.array_equal(x, want)

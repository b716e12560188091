"""Collectives in MPI's own words, for the trainer and for users, on device buffers.

    coll = Collectives(world, device, allreduce="ring")
    coll.Allreduce(grads, op="mean")
    evens = coll.Split(world.rank % 2)          # a Collectives over a subgroup

Every method is collective over ``world.comm``: every rank of the group calls
it, in the same order, with buffers of agreed sizes (zero-length included).
Buffers are the device's arrays (NumPy on cpu, numba device arrays on cuda);
they reach MPI only through :class:`~hpctrain.comm.staging.Staging`, so with
a GPU and no CUDA-aware MPI each call copies through pinned host memory.
"""

from __future__ import annotations

import numpy as np

from ..runtime import World
from .reduce_ops import mpi_op
from .staging import Staging


class Collectives:
    """MPI collectives over ``world.comm`` for buffers on ``device``.

    ``allreduce`` names the strategy behind :meth:`Allreduce` (see
    ``hpctrain.comm.STRATEGIES``); ``staging`` defaults to ``Staging(device)``.
    """

    def __init__(self, world, device, staging=None, allreduce: str = "mpi"):
        from . import make_allreduce

        self.world, self.device, self.comm = world, device, world.comm
        self.rank, self.size = world.rank, world.size
        self.staging = staging or Staging(device)
        self.allreduce_name = allreduce
        self._allreduce = make_allreduce(allreduce, world, device, self.staging)

    def Allreduce(self, buf, op: str = "sum"):
        """Reduce ``buf`` in place over the group with the chosen strategy (op: sum, mean, max, min)."""
        return self._allreduce(buf, op)

    def Bcast(self, buf, root: int = 0):
        """Every rank's ``buf`` becomes a copy of rank ``root``'s. Returns ``buf``."""
        with self.staging.mpi_view(buf, slot="bcast") as view:
            self.comm.Bcast(view, root=root)
        return buf

    def Allgather(self, sendbuf, recvbuf):
        """``recvbuf`` (size * n) receives every rank's ``sendbuf`` (n), in rank order."""
        self.Allgatherv(sendbuf, recvbuf, [sendbuf.size] * self.size)
        return recvbuf

    def Allgatherv(self, sendbuf, recvbuf, counts):
        """``recvbuf`` (sum(counts)) receives rank i's ``sendbuf`` (counts[i], may be 0) at offset
        sum(counts[:i]). ``counts`` is the same list on every rank."""
        counts = _check_counts(counts, self.size, sendbuf.size, self.rank, recvbuf.size, "Allgatherv")
        displs = _displacements(counts)
        with self.staging.mpi_view(sendbuf, slot="gather-send") as send, \
                self.staging.mpi_view(recvbuf, slot="gather-recv") as recv:
            self.comm.Allgatherv(send, [recv, (counts, displs)])
        return recvbuf

    def Reduce_scatter(self, sendbuf, recvbuf, counts, op: str = "sum"):
        """Reduce ``sendbuf`` (sum(counts)) over the group; rank i's ``recvbuf`` (counts[i], may
        be 0) receives elements sum(counts[:i]) onwards. op: sum, mean (scaled once), max, min."""
        counts = _check_counts(counts, self.size, recvbuf.size, self.rank, sendbuf.size, "Reduce_scatter")
        reduction = mpi_op(op)
        with self.staging.mpi_view(sendbuf, slot="scatter-send") as send, \
                self.staging.mpi_view(recvbuf, slot="scatter-recv") as recv:
            self.comm.Reduce_scatter(send, recv, recvcounts=counts, op=reduction)
        if op == "mean" and self.size > 1 and recvbuf.size:
            self.device.ops.scale(recvbuf, 1.0 / self.size)
        return recvbuf

    def Barrier(self):
        """Return once every rank of the group has called Barrier."""
        self.comm.Barrier()

    def Split(self, color: int, key: int | None = None) -> Collectives:
        """The Collectives of this rank's subgroup: the ranks that passed the same ``color``,
        ordered by ``key`` (default: rank here). Same device, staging and strategy.

        Nodes of the subgroup are the parent's nodes (its members that share a
        node_rank), so ranks simulated as nodes stay so.
        """
        sub = self.comm.Split(color, self.rank if key is None else key)
        return Collectives(sub_world(self.world, sub), self.device, self.staging, self.allreduce_name)


def sub_world(world, comm) -> World:
    """The World of ``comm``, a subcommunicator of ``world.comm``, keeping the parent's nodes.

    Like runtime.init_world, but a node is split by the parent's node_rank
    rather than by shared memory, which would forget ``ranks_per_node``.
    """
    rank = comm.Get_rank()
    local = comm.Split(color=world.node_rank, key=rank)
    # nodes named by their first member's rank, numbered in rank order (as init_world)
    leader = local.bcast(rank, root=0)
    named = comm.allgather((leader, local.Get_rank()))
    leaders = sorted({first for first, _ in named})
    cross = comm.Split(color=local.Get_rank(), key=rank)
    return World(comm=comm, rank=rank, size=comm.Get_size(), local_comm=local,
                 local_rank=local.Get_rank(), local_size=local.Get_size(), cross_comm=cross,
                 node_rank=leaders.index(leader), n_nodes=len(leaders),
                 where=tuple((leaders.index(first), local_rank) for first, local_rank in named))


def _check_counts(counts, size, mine, rank, total, what) -> list[int]:
    """``counts`` as ints, after checking it against the group and the buffers (ValueError)."""
    counts = [int(c) for c in counts]
    if len(counts) != size or min(counts, default=0) < 0:
        raise ValueError(f"{what}: counts {counts} must hold {size} non-negative entries, one per rank")
    if counts[rank] != mine or sum(counts) != total:
        raise ValueError(f"{what}: rank {rank} has a per-rank buffer of {mine} and a whole buffer of "
                         f"{total} elements; counts {counts} ask for {counts[rank]} and {sum(counts)}")
    return counts


def _displacements(counts) -> list[int]:
    """Offsets of each rank's block: 0, c0, c0 + c1, ..."""
    return [0, *np.cumsum(counts[:-1], dtype=np.int64).tolist()]

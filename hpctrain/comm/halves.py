"""An all-reduce's two halves, reduce-scatter and all-gather, as ZeRO (:mod:`.zero`) uses them.

A strategy with halves provides ``reduce_scatter(buf)`` (the sum over ranks of ``buf``, a gradient
bucket, lands in this rank's chunk of it, in place; the other chunks are left undefined),
``allgather(buf)`` (every chunk of ``buf`` becomes its owner's) and ``owned_chunk(rank, size)``.
Chunks are :func:`~.ring.chunk_offsets`'s. Collective over the strategy's communicator. Here: the
MPI library's halves (MPI_Reduce_scatter, MPI_Allgatherv, for ``mpi``: on the host copy,
:func:`~.ring.host_halves`) and :class:`WholeSumHalves` for strategies without halves of their
own, whose reduce-scatter is their whole all-reduce (op sum) and all-gather MPI_Allgatherv.
``native_halves`` says which a strategy has (for the traffic count and the parameter all-gathers).
"""

from __future__ import annotations

import numpy as np

from .ring import chunk_offsets, host_halves


def mpi_reduce_scatter(comm, x, rank: int, size: int, scratch) -> None:
    """MPI_Reduce_scatter (sum) of host ``x`` into a scratch chunk, copied to chunk ``rank``."""
    from mpi4py import MPI

    off = chunk_offsets(x.size, size)
    counts = np.diff(off).tolist()
    recv = scratch.get(x.dtype, counts[rank])
    comm.Reduce_scatter(x, recv, recvcounts=counts, op=MPI.SUM)
    x[off[rank]:off[rank + 1]] = recv


def mpi_allgather(comm, x, size: int) -> None:
    """MPI_Allgatherv in place: chunk r of host ``x`` from rank r, to every rank."""
    from mpi4py import MPI

    off = chunk_offsets(x.size, size)
    comm.Allgatherv(MPI.IN_PLACE, [x, (np.diff(off).tolist(), off[:-1])])


class WholeSumHalves:
    """ZeRO's halves for a strategy without its own (naive; shm and auto for buffers their own do not
    fit; hierarchical on nodes of unequal size): the reduce-scatter is the strategy's whole all-reduce with op sum (every chunk summed; this rank
    keeps chunk ``rank``), so a ZeRO step adds in exactly the order of the strategy's all-reduce, at
    the cost of its whole traffic instead of half; the all-gather is MPI_Allgatherv in place. Mixed
    into a strategy that has ``comm``, ``size``, ``staging`` and ``__call__(buf, op)``."""

    native_halves = False  # whether reduce_scatter sends half an all-reduce (traffic_halves, gatherer)

    @staticmethod
    def owned_chunk(rank: int, size: int) -> int:
        return rank

    def reduce_scatter(self, buf):
        return self(buf, "sum")

    def allgather(self, buf):
        return host_halves(self, buf, lambda x: mpi_allgather(self.comm, x, self.size))

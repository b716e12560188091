"""``hierarchical`` strategy: inside the node, then across nodes, then inside again.

  1. intra-node reduce-scatter: local rank c (c < L) receives the node's sum of
     chunk c of the buffer, over shared memory;
  2. inter-node all-reduce: every local rank c < L all-reduces its chunk over
     ``cross_comm`` (the ranks with local rank c on every node), all L in
     parallel, with any flat inner strategy (``inner``: mpi, ring, rhd, ...);
  3. intra-node all-gather: every rank of the node receives every chunk.

Only 1/L of the buffer crosses the slow link per rank, instead of a flat ring's
every hop. L is the smallest node size in the job, so nodes of unequal size
(3 ranks as 2 + 1) work: local ranks >= L own an empty chunk, receive their
node's result in phase 3, and sit out phase 2 (their ``cross_comm`` does not
reach every node). Chunk boundaries depend only on (n, L), identical on every
node, so chunk c means the same elements everywhere.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .staging import Staging


def chunk_counts(n: int, parts: int) -> list[int]:
    """``n`` elements in ``parts`` near-equal contiguous chunks (the first n % parts one longer)."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


class HierarchicalAllreduce:
    def __init__(self, world, device, staging=None, inner: str = "mpi"):
        from mpi4py import MPI

        from ..device import CpuDevice
        from . import STRATEGIES

        if inner == "hierarchical":
            raise ValueError("the inner strategy of hierarchical must be flat (mpi, ring, rhd, naive)")
        self.world, self.device = world, device
        self.staging = staging or Staging(device)
        self.size = world.size
        # one agreed chunk count: the smallest node
        self.L = world.comm.allreduce(world.local_size, op=MPI.MIN)
        self.in_cross = world.local_rank < self.L
        self._mpi_ops = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._inner = None
        if self.in_cross and world.n_nodes > 1:
            cross = dataclasses.replace(world, comm=world.cross_comm, rank=world.cross_comm.Get_rank(),
                                        size=world.cross_comm.Get_size())
            # phase 2 works on host memory that staging already produced
            self._inner = STRATEGIES[inner](cross, CpuDevice(device.dtype))
        self._scratch = {}

    def __call__(self, buf, op="mean"):
        if op not in self._mpi_ops:
            raise ValueError(f"all-reduce op {op!r}: choose sum, mean, max or min")
        w = self.world
        with self.staging.mpi_view(buf) as host:
            flat = host.reshape(-1)
            n = flat.size
            counts = chunk_counts(n, self.L) + [0] * (w.local_size - self.L)
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
            mine = self._chunk(counts[w.local_rank], flat.dtype)
            # 1. intra-node reduce-scatter (shared memory)
            w.local_comm.Reduce_scatter(flat, mine, recvcounts=counts, op=self._mpi_ops[op])
            # 2. inter-node all-reduce of this rank's chunk, all local ranks in parallel
            if self._inner is not None and mine.size:
                self._inner(mine, "sum" if op == "mean" else op)
            # 3. intra-node all-gather
            w.local_comm.Allgatherv(mine, [flat, (counts, displs)])
        if op == "mean" and self.size > 1:
            self.device.ops.scale(buf, 1.0 / self.size)
        return buf

    def _chunk(self, count, dtype):
        """A receive buffer for this rank's chunk, reused between calls of the same size."""
        key = (count, np.dtype(dtype).str)
        if key not in self._scratch:
            self._scratch[key] = np.empty(count, dtype=dtype)
        return self._scratch[key]

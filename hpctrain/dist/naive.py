"""``naive`` strategy, the test oracle: MPI_Reduce to rank 0, then MPI_Bcast.

Rank 0 sums all contributions in one reduction and every rank receives the
identical bytes, so results are bitwise equal across ranks by construction.
"""

import numpy as np

from .staging import Staging


class NaiveAllreduce:
    def __init__(self, world, device):
        from mpi4py import MPI

        self.comm, self.rank, self.size, self.device = world.comm, world.rank, world.size, device
        self.staging = Staging(device)
        self._sum = MPI.SUM

    def __call__(self, buf, op="mean"):
        with self.staging.mpi_view(buf) as host:
            # reduce to rank 0
            total = np.empty_like(host) if self.rank == 0 else None
            self.comm.Reduce(host, total, op=self._sum, root=0)
            if self.rank == 0:
                host[...] = total
            # broadcast the sum
            self.comm.Bcast(host, root=0)
        if op == "mean" and self.size > 1:
            self.device.ops.scale(buf, 1.0 / self.size)
        return buf

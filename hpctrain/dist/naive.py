"""``naive`` strategy, the test oracle: MPI_Reduce to rank 0, then MPI_Bcast.

Rank 0 sums all contributions in one reduction and every rank receives the
identical bytes, so results are bitwise equal across ranks by construction.
"""

from .staging import Staging


class NaiveAllreduce:
    def __init__(self, world, device, staging=None):
        from mpi4py import MPI

        self.comm, self.rank, self.size, self.device = world.comm, world.rank, world.size, device
        self.staging = staging or Staging(device)
        self._sum, self._in_place = MPI.SUM, MPI.IN_PLACE

    def __call__(self, buf, op="mean"):
        with self.staging.mpi_view(buf) as mpi_buf:
            # reduce to rank 0 (in place at the root)
            if self.rank == 0:
                self.comm.Reduce(self._in_place, mpi_buf, op=self._sum, root=0)
            else:
                self.comm.Reduce(mpi_buf, None, op=self._sum, root=0)
            # broadcast the sum
            self.comm.Bcast(mpi_buf, root=0)
        if op == "mean" and self.size > 1:
            self.device.ops.scale(buf, 1.0 / self.size)
        return buf

"""``naive`` strategy, the test oracle: MPI_Reduce to rank 0, then MPI_Bcast.

Rank 0 reduces all contributions in one reduction and every rank receives the
identical bytes, so results are bitwise equal across ranks by construction.
"""

from .halves import WholeSumHalves
from .reduce_ops import mpi_op
from .staging import Staging


class NaiveAllreduce(WholeSumHalves):
    """Collective over ``world.comm``: every rank calls it with a buffer of one size and dtype.
    ZeRO's halves: its whole sum, then MPI_Allgatherv (the oracle's)."""

    def __init__(self, world, device, staging=None):
        from mpi4py import MPI

        self.comm, self.rank, self.size, self.device = world.comm, world.rank, world.size, device
        self.staging = staging or Staging(device)
        self._in_place = MPI.IN_PLACE

    def __call__(self, buf, op="mean"):
        """Reduce ``buf`` in place over all ranks (op: sum, mean, max, min); returns ``buf``."""
        mpi_reduction = mpi_op(op)  # unknown ops fail here, before any MPI call
        with self.staging.mpi_view(buf) as mpi_buf:
            # reduce to rank 0 (in place at the root)
            if self.rank == 0:
                self.comm.Reduce(self._in_place, mpi_buf, op=mpi_reduction, root=0)
            else:
                self.comm.Reduce(mpi_buf, None, op=mpi_reduction, root=0)
            # broadcast the result
            self.comm.Bcast(mpi_buf, root=0)
        if op == "mean" and self.size > 1:
            self.device.ops.scale(buf, 1.0 / self.size)
        return buf


"""``mpi`` strategy: MPI_Allreduce in place; the library picks its own algorithm."""

from .halves import mpi_allgather, mpi_reduce_scatter
from .reduce_ops import mpi_op
from .ring import HostScratch, host_halves
from .staging import Staging


class MpiAllreduce:
    """Collective over ``world.comm``: every rank calls it with a buffer of one size and dtype."""

    def __init__(self, world, device, staging=None):
        from mpi4py import MPI

        self.comm, self.rank, self.size, self.device = world.comm, world.rank, world.size, device
        self.staging = staging or Staging(device)
        self._in_place = MPI.IN_PLACE
        self.scratch = HostScratch()

    def __call__(self, buf, op="mean"):
        """Reduce ``buf`` in place over all ranks (op: sum, mean, max, min); returns ``buf``.

        ``mean`` is the sum scaled once by 1/size. NaN in max/min: Open MPI's
        answer depends on the order it combines ranks (see reduce_ops).
        """
        mpi_reduction = mpi_op(op)  # unknown ops fail here, before any MPI call
        with self.staging.mpi_view(buf) as mpi_buf:
            self.comm.Allreduce(self._in_place, mpi_buf, op=mpi_reduction)
        if op == "mean" and self.size > 1:
            self.device.ops.scale(buf, 1.0 / self.size)
        return buf

    # ZeRO's halves (hpctrain.comm.halves): MPI_Reduce_scatter, then MPI_Allgatherv in place
    native_halves = True

    @staticmethod
    def owned_chunk(rank: int, size: int) -> int:
        return rank

    def reduce_scatter(self, buf):
        return host_halves(self, buf, lambda x: mpi_reduce_scatter(self.comm, x, self.rank, self.size, self.scratch))

    def allgather(self, buf):
        return host_halves(self, buf, lambda x: mpi_allgather(self.comm, x, self.size))

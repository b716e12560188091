"""``mpi`` strategy: MPI_Allreduce in place; the library picks its own algorithm."""

from .reduce_ops import mpi_op
from .staging import Staging


class MpiAllreduce:
    """Collective over ``world.comm``: every rank calls it with a buffer of one size and dtype."""

    def __init__(self, world, device, staging=None):
        from mpi4py import MPI

        self.comm, self.size, self.device = world.comm, world.size, device
        self.staging = staging or Staging(device)
        self._in_place = MPI.IN_PLACE

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

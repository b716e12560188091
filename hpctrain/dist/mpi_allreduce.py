"""``mpi`` strategy: MPI_Allreduce in place; the library picks its own algorithm."""

from .staging import Staging


class MpiAllreduce:
    def __init__(self, world, device, staging=None):
        from mpi4py import MPI

        self.comm, self.size, self.device = world.comm, world.size, device
        self.staging = staging or Staging(device)
        self._in_place, self._ops = MPI.IN_PLACE, {"sum": MPI.SUM, "mean": MPI.SUM}

    def __call__(self, buf, op="mean"):
        """Reduce ``buf`` in place over all ranks; ``mean`` divides the sum by the world size."""
        with self.staging.mpi_view(buf) as mpi_buf:
            self.comm.Allreduce(self._in_place, mpi_buf, op=self._ops[op])
        if op == "mean" and self.size > 1:
            self.device.ops.scale(buf, 1.0 / self.size)
        return buf

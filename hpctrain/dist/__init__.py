"""Gradient communication: all-reduce strategies behind one interface.

A strategy is a callable ``allreduce(buf, op)`` that reduces the device buffer
``buf`` in place over ``world.comm`` (op: "sum" or "mean"), reaching MPI only
through :class:`~hpctrain.dist.staging.Staging`. Choose by name:

| name  | algorithm                       | use it for                                   |
|-------|---------------------------------|----------------------------------------------|
| mpi   | MPI_Allreduce(IN_PLACE)         | the default; the MPI library's own tuning    |
| naive | MPI_Reduce to rank 0 + MPI_Bcast | the test oracle; never fast                  |

Ring, recursive halving-doubling, hierarchical and auto strategies, buckets
and the communication thread join this package in issue 4.
"""

from .mpi_allreduce import MpiAllreduce
from .naive import NaiveAllreduce

STRATEGIES = {"mpi": MpiAllreduce, "naive": NaiveAllreduce}


def make_allreduce(name: str, world, device, staging=None):
    """The strategy called ``name`` for ``world`` and buffers living on ``device``.

    ``staging`` (default: ``Staging(device)`` with auto detection) is how
    device buffers reach MPI.
    """
    return STRATEGIES[name](world, device, staging)

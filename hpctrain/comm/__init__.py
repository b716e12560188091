"""Gradient communication: all-reduce strategies behind one interface (docs/dist.md, "Strategies").

A strategy ``X(world, device, staging=None, ...)`` is called as ``allreduce(buf, op="mean") -> buf``:
collective over ``world.comm`` (every rank passes a buffer of the same size and dtype, size 0
included), it reduces the device buffer in place. op: "sum", "mean" (the sum scaled once by 1/size),
"max", "min"; float32 and float64. Buffers reach MPI only through :class:`~.staging.Staging`.
:func:`make_allreduce` builds one by name (``dist.allreduce``):

  mpi           MPI_Allreduce in place: the default; the library's tuning, CUDA-aware MPI without copies
  naive         MPI_Reduce to rank 0 + MPI_Bcast: the test oracle, never fast
  ring          reduce-scatter + all-gather over Sendrecv: large buffers on few ranks
  rhd           recursive halving-doubling: small and mid-sized buffers, larger worlds
  hierarchical  in the node, across nodes (an inner strategy), in the node: a slow link between nodes
  shm           the ranks fold slices of one shared window, no messages: one machine only
  auto          per message size, the strategy that start-up timings predict fastest (not in STRATEGIES)

ring and rhd reduce on the host and give every rank the same bytes, equal to naive's to rounding.
Buckets and the communication thread: :mod:`.buckets`; MPI-style collectives: :mod:`.collectives`;
tensor-parallel groups: :mod:`.grid`.
"""

from .auto import AutoAllreduce
from .flat import FLAT
from .hierarchical import HierarchicalAllreduce

STRATEGIES = {**FLAT, "hierarchical": HierarchicalAllreduce}


def make_allreduce(name: str, world, device, staging=None, inner: str = "mpi", cache_path: str = "", log=None):
    """The strategy called ``name`` for ``world`` and buffers living on ``device``. Collective.

    ``staging`` (default: ``Staging(device)`` with auto detection) is how
    device buffers reach MPI; ``inner`` is hierarchical's cross-node strategy;
    ``cache_path`` and ``log`` are auto's fit cache and where it reports.
    """
    if name == "hierarchical":
        return HierarchicalAllreduce(world, device, staging, inner=inner)
    if name == "auto":
        return AutoAllreduce(world, device, staging, cache_path=cache_path, log=log)
    return STRATEGIES[name](world, device, staging)

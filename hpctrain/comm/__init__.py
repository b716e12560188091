"""Gradient communication: all-reduce strategies behind one interface.

A strategy is a class ``X(world, device, staging=None)`` whose instances are
called as ``allreduce(buf, op="mean") -> buf``: a collective over ``world.comm``
(every rank calls it with a buffer of the same size and dtype, size 0 included)
that reduces the device buffer ``buf`` in place. op: "sum", "mean" (the sum
scaled once by 1/size), "max", "min"; dtypes float32 and float64. Buffers reach
MPI only through :class:`~hpctrain.comm.staging.Staging`. Choose by name
(N elements, p ranks, p2 the largest power of two <= p):

| name         | algorithm                               | sent per rank (msgs / elements)    | use it for                                 |
|--------------|-----------------------------------------|------------------------------------|--------------------------------------------|
| mpi          | MPI_Allreduce(IN_PLACE)                 | the library's choice               | the default; the MPI library's own tuning, |
|              |                                         |                                    | and CUDA-aware MPI without host copies     |
| naive        | MPI_Reduce to rank 0 + MPI_Bcast        | rank 0 receives (p-1) N            | the test oracle; never fast                |
| ring         | reduce-scatter + all-gather over        | 2(p-1) / 2N(p-1)/p                 | large buffers (MBs) on few ranks: bandwidth|
|              | Sendrecv, host reduction                |                                    | optimal, latency grows with p              |
| rhd          | recursive halving-doubling              | 2 log2 p2 / 2N(p2-1)/p2, + 2N for  | small and mid-sized buffers, larger worlds:|
|              | (Rabenseifner), host reduction          | the 2(p-p2) ranks folded in        | log-many messages; best at powers of two   |
| hierarchical | reduce-scatter in the node, all-reduce  | across the link: 2N(n-1)/(n L) per | several nodes joined by a slower link than |
|              | across nodes (``hierarchical_inner``),  | rank (n nodes, L ranks per node)   | shared memory: the link carries 1/L of a   |
|              | all-gather in the node                  |                                    | flat ring's traffic                        |
| shm          | ranks of one machine fold slices of a   | no messages: reads and writes N    | one machine only (ValueError elsewhere):   |
|              | shared window (MPI-3 shared memory);    | elements per rank, 2 syncs; +2N of | fastest from ~64-256 KB here; the trainer's|
|              | zero copy for ``allocate()``d buffers   | copies for other buffers           | CPU gradient buffer lives in its window    |
| auto         | per message size, the strategy alpha-   | -                                  | when unsure: measured at start-up (cached  |
|              | beta lines between probes predict best  |                                    | in ``dist.auto_cache``), logged once; on   |
|              | (shm zero-copy among them on one        |                                    | one machine with CPU ranks it keeps the    |
|              | machine)                                |                                    | gradients in shm's window                  |

ring and rhd reduce on the host (pinned copies of GPU buffers even with a
CUDA-aware MPI) and give bitwise equal results on every rank; their summation
order differs from naive's, so sums agree with it to rounding only.
``auto`` is built by :func:`make_allreduce` (it times the others), not listed
in ``STRATEGIES``.

Gradient buckets and the communication thread that overlaps them with
backward are in :mod:`.buckets`; the MPI-style collectives API is
:mod:`.collectives`; the process grid of tensor parallelism (tensor groups
and the data-parallel groups these strategies then run over) is :mod:`.grid`.
"""

from .mpi_allreduce import MpiAllreduce
from .naive import NaiveAllreduce
from .rhd import RhdAllreduce
from .ring import RingAllreduce
from .hierarchical import HierarchicalAllreduce  # noqa: I001 - looks up STRATEGIES at call time
from .shm import ShmAllreduce
from .auto import AutoAllreduce

STRATEGIES = {"mpi": MpiAllreduce, "naive": NaiveAllreduce, "ring": RingAllreduce, "rhd": RhdAllreduce,
              "hierarchical": HierarchicalAllreduce,
              "shm": ShmAllreduce}


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

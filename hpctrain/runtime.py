"""The MPI world and its topology, initialised on first use (never at import).

``init_world()`` works the same under ``mpirun``, ``srun`` and with no launcher
(a 1-rank world). A *node* is the set of ranks sharing memory
(``Split_type(COMM_TYPE_SHARED)``), unless ``ranks_per_node=k`` makes
consecutive blocks of k ranks act as nodes, so one machine can stand in for a
cluster in tests and benchmarks (the last node may be smaller).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


def _mpi():
    """Import mpi4py.MPI (this is MPI_Init), asking for MPI_THREAD_MULTIPLE.

    The communication thread of the bucketed all-reduce calls MPI while the
    main thread runs backward, so the thread level is requested up front.
    """
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


@dataclass(frozen=True)
class World:
    """Who this process is among the ranks of a job. Named fields, no tuples.

    comm        the job's communicator (COMM_WORLD or a test's COMM_SELF/dup)
    rank, size  this rank's index and the number of ranks in ``comm``
    local_comm  the ranks of this node; ``local_rank``/``local_size`` within it
    cross_comm  ranks with the same local_rank on every node (inter-node hops)
    node_rank   index of this node (0 .. n_nodes-1, in order of first rank)
    where       (node_rank, local_rank) of every rank, in rank order (empty: not known)
    """

    comm: Any
    rank: int
    size: int
    local_comm: Any
    local_rank: int
    local_size: int
    cross_comm: Any
    node_rank: int
    n_nodes: int
    where: tuple = ()

    @property
    def is_root(self) -> bool:
        """Rank 0 prints, logs and renames checkpoints."""
        return self.rank == 0


def init_world(comm=None, ranks_per_node: int = 0) -> World:
    """Initialise MPI (if needed) and describe the topology of ``comm``.

    Collective over ``comm`` (default COMM_WORLD): every rank must call it.
    """
    MPI = _mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    if ranks_per_node and ranks_per_node > 0:
        local_comm = comm.Split(color=rank // ranks_per_node, key=rank)
    else:
        local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
    # A node is named by the world rank of its first member; sorting those
    # names numbers the nodes in rank order on every rank alike.
    leader = local_comm.bcast(rank, root=0)
    named = comm.allgather((leader, local_rank))
    leaders = sorted({first for first, _ in named})
    cross_comm = comm.Split(color=local_rank, key=rank)
    return World(comm=comm, rank=rank, size=size,
                 local_comm=local_comm, local_rank=local_rank, local_size=local_size,
                 cross_comm=cross_comm, node_rank=leaders.index(leader), n_nodes=len(leaders),
                 where=tuple((leaders.index(first), local) for first, local in named))


def launched_ranks_on_node() -> int:
    """Ranks a launcher put on this node, read from its environment (1 if none).

    Read before numpy is imported, to size each rank's BLAS thread pool.
    """
    from .reliability.slurm import step_tasks_on_node

    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return max(1, int(value))
    # srun: the step's count on this node (srun -n 2 sets no SLURM_NTASKS_PER_NODE;
    # missing it gave 2 ranks x 2 spinning threads on 2 cores, ~70x slower steps)
    step = step_tasks_on_node()
    if step:
        return step
    value = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    if value.split("(")[0].isdigit():
        return max(1, int(value.split("(")[0]))
    return 1


def launched_rank() -> int:
    """This process's rank as the launcher announced it (0 without a launcher); no MPI needed."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def limit_threads_per_rank() -> None:
    """Give each rank its share of the cores for BLAS/numba threads, unless the user chose.

    Without this, 4 ranks on 2 cores each start 2 OpenBLAS threads and the
    oversubscription costs more than the parallel GEMM gains. The share is the
    smaller of the cores this rank may run on (a launcher's binding) and the
    node's cores divided by the ranks on it (bindings to a whole socket are
    shared). If any of the thread variables is set, all are left alone. Must
    run before numpy is imported; called by the command-line entry point, the
    benchmarks and the MPI test ranks (tests/conftest.py), never at import.
    """
    # OpenBLAS's threads spin for ~2^28 cycles after each call before they sleep, on the cores
    # the CPU ops' threads (kernels/support/cpu_threads.py) need next: a GPT step on 2 cores gained
    # nothing from a second op thread until they slept at once (2^4 cycles): 250 -> 200 ms
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if any(var in os.environ for var in THREAD_VARS):
        return
    cores = len(os.sched_getaffinity(0))
    per_rank = max(1, min(cores, (os.cpu_count() or 1) // launched_ranks_on_node()))
    for var in THREAD_VARS:
        os.environ[var] = str(per_rank)


def cpu_list(cpus) -> str:
    """CPU numbers as ranges, as taskset and --report-bindings write them: {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def binding() -> dict:
    """This process's core binding and thread counts: ``cores`` (how many it may run on), ``cpus``
    (which, as "0-3"), ``ops`` (threads a CPU op is split over), ``blas`` (BLAS threads: OpenBLAS's
    own count where it says, else OPENBLAS_NUM_THREADS / OMP_NUM_THREADS) and ``numba``
    (NUMBA_NUM_THREADS)."""
    from .kernels.support import cpu_threads

    cpus = cpu_threads.cpus()
    blas = cpu_threads.blas_threads()
    env = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "-"
    return {"cores": len(cpus), "cpus": cpu_list(cpus), "ops": cpu_threads.threads(),
            "blas": blas if blas is not None else env, "numba": os.environ.get("NUMBA_NUM_THREADS", "-")}


def oversubscribed_note(bound: dict | None = None) -> str | None:
    """The warning for a rank whose CPU ops or BLAS use more threads than it has cores (a launcher's
    binding narrower than the threads asked for), else None. ``bound``: :func:`binding` (None:
    this process's now; a failure to read it is no warning, so every rank still answers a
    collective that gathers the notes)."""
    if bound is None:
        try:
            bound = binding()
        except Exception:  # noqa: BLE001 - a report, never a reason to stop
            return None
    threads = max(int(bound["ops"]), int(bound["blas"]) if str(bound["blas"]).isdigit() else 0)
    if threads <= bound["cores"]:
        return None
    return (f"this rank is bound to {bound['cores']} core(s) (CPUs {bound['cpus']}) but runs {threads} threads "
            f"(CPU ops {bound['ops']}, BLAS {bound['blas']}): they take turns on its cores. Give each rank as "
            f"many cores as threads (mpirun --bind-to none or --map-by slot:PE={threads}; srun --cpus-per-task="
            f"{threads}) or set OMP_NUM_THREADS={bound['cores']}")


YIELD_VAR = "OMPI_MCA_mpi_yield_when_idle"


def yield_when_oversubscribed() -> None:
    """With more ranks on this node than cores, have Open MPI yield the core while a rank waits,
    unless the user chose (``OMPI_MCA_mpi_yield_when_idle`` set). Open MPI yields by itself only
    when its own launcher knows the node is oversubscribed (``mpirun --oversubscribe``); started
    by srun on a node that declares more CPUs than it has (as the tests' local SLURM cluster
    does), or with any binding the launcher believes, a rank waiting in a collective polls
    without yielding and takes the core a computing rank needs: 4 ranks of a small MLP on 2
    cores under srun ran 300 steps in 8.2-8.5 s, and in 1.9-2.5 s with yielding (the same VM,
    back to back). Other MPI libraries ignore the variable. Must run before MPI_Init; called
    where :func:`limit_threads_per_rank` is, never at import.
    """
    if YIELD_VAR not in os.environ and launched_ranks_on_node() > (os.cpu_count() or 1):
        os.environ[YIELD_VAR] = "1"

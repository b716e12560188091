"""Shared fixtures.

Serial tests run in one plain process. Tests marked ``mpi`` run under
``mpirun -n 1..4 ... pytest --with-mpi`` (scripts/test.sh): every rank runs the
same test, so fixtures that make files do it on rank 0 and broadcast the path.
Tests that *launch* mpirun themselves are serial tests (nested mpirun does not work).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile

import pytest

# CUDA kernels run on numba's simulator unless the caller decided otherwise:
# NUMBA_ENABLE_CUDASIM=0 on a GPU machine runs them on the GPU (scripts/test.sh
# does that for the tests marked gpu). numba reads this once, at import, so it
# is set here, before any test module imports numba.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def _share_the_cores_between_ranks() -> bool:
    """Under mpirun (the MPI test phases: pytest --with-mpi), each rank gets its share of the cores
    for BLAS and numba threads, as ``python -m hpctrain`` gives its ranks; before any test module
    imports numpy. Returns whether the caller had set a thread count (then nothing is touched).

    Without it every rank starts a thread per core: 3 ranks on 2 cores ran tests/test_mpi_zero.py
    in 85 s against 33 s, the waiting OpenBLAS threads spinning on the cores the others need.
    Plain pytest (one process, even inside a SLURM allocation) is left alone: the counts would
    pass to the jobs it launches.
    """
    from hpctrain.runtime import THREAD_VARS, launched_ranks_on_node, limit_threads_per_rank, yield_when_oversubscribed

    caller_set = any(var in os.environ for var in THREAD_VARS)
    if "--with-mpi" in sys.argv and launched_ranks_on_node() > 1:
        limit_threads_per_rank()
        yield_when_oversubscribed()
    return caller_set


CALLER_SET_THREADS = _share_the_cores_between_ranks()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """Under the simulator, every test's kernels (with a CudaDevice or without one) run on a
    simulator made safe for concurrent launches, shared arrays and barriers (the opt-in test tool
    hpctrain.testing.simulator; production code patches nothing). Nothing changes on a GPU. In the
    MPI phases, checkpoint reads run in forked children (tests/forked_children.py)."""
    from hpctrain.testing.simulator import make_thread_safe

    make_thread_safe()
    if config.getoption("--with-mpi", default=False):
        # the MPI phases read checkpoints in children forked from a server that has made their
        # imports (tests/forked_children.py): a fresh python's start-up was a quarter of them
        import forked_children

        forked_children.install()

# small, fast datasets: 8 features, 4 classes
SMALL = {"n": 2048, "dim": 8, "classes": 4}


def real_gpu_reason() -> str:
    """Why tests marked gpu cannot run here ('' when a real GPU is usable)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return ("numba CUDA simulator active; scripts/test.sh reruns the gpu tests with "
                "NUMBA_ENABLE_CUDASIM=0 when nvidia-smi lists a GPU")
    from hpctrain.device import cuda_status

    n, why = cuda_status()
    return "" if n else f"no GPU visible ({why})"


# The longest serial modules (seconds measured in CI, 2 cores), started first: the serial phase
# runs on two xdist workers a module at a time (--dist loadfile), and a long module started
# last leaves the other worker idle at the end. Order only; every test still runs.
LONGEST_FIRST = ("test_compress_cuda", "test_fuzz_checkpoint", "test_gpt_cuda_step", "test_gpu_check",
                 "test_numguard", "test_launch", "test_emulated_cluster", "test_softmax_xent", "test_recompute",
                 "test_benchmarks", "test_checkpoint_jobs", "test_embedding", "test_layernorm", "test_cli",
                 "test_scaling_benchmark", "test_cuda_compile", "test_compress_convergence", "test_quantize16",
                 "test_compress_gpt_convergence", "test_gpt_train", "test_checkpoint_state")


def pytest_runtest_setup(item):
    """``@pytest.mark.compares_ranks``: the test compares N ranks with one rank (or what the ranks
    exchange); under ``mpirun -n 1`` it would compare a run with itself, so it is skipped there."""
    if item.get_closest_marker("compares_ranks") is not None and item.get_closest_marker("mpi") is not None:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() == 1:
            pytest.skip("compares ranks with one rank: at one rank it would compare a run with itself")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2] if item.module else "",
                                         len(rank)))  # stable: the rest keep their order
    gpu_items = [item for item in items if "gpu" in item.keywords]
    reason = real_gpu_reason() if gpu_items else ""
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


def make_small_dataset(folder: str, n: int = SMALL["n"], seed: int = 1, name: str = "train.h5") -> str:
    from hpctrain.data.synth import write_synthetic

    path = os.path.join(folder, name)
    if not os.path.exists(path):
        write_synthetic(path, n, SMALL["dim"], SMALL["classes"], seed=seed, teacher_seed=0)
    return path


def make_text_file(folder: str, name: str = "text.h5", val_percent: float = 20) -> str:
    """A small byte-level token file of real text: the standard library's json and email packages
    (~400 KB of /train and ~32 KB (5 documents) of /val at 20 %, ~6 KB (2 documents) at 5 %;
    bigram baseline ~3.7 bits per byte)."""
    from hpctrain.data.text import stdlib_root, write_token_file

    path = os.path.join(folder, name)
    if not os.path.exists(path):
        write_token_file(path, [os.path.join(stdlib_root(), pkg) for pkg in ("json", "email")],
                         val_percent=val_percent)
    return path


@pytest.fixture(scope="module")
def dev64():
    """A float64 CUDA device (the simulator unless NUMBA_ENABLE_CUDASIM=0), one per test module."""
    from hpctrain.device import CudaDevice

    return CudaDevice("float64")


@pytest.fixture(scope="module")
def dev32():
    """A float32 CUDA device, one per test module."""
    from hpctrain.device import CudaDevice

    return CudaDevice("float32")


def up(dev, a):
    """A device array holding host array ``a``, in ``a``'s own dtype (not the device's)."""
    return dev.from_host(a, a.dtype)


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    """Path of the small token file with a 5 % /val (~6 K tokens; the 3 documents the 20 % file holds
    out beyond it are in /train here), made once per serial session: a run's final evaluation scores
    the whole /val. Tests on it compare runs with each other or hold loose bounds (all passed on it
    when it was introduced); the convergence targets use :func:`text_data_wide_val`."""
    return make_text_file(str(tmp_path_factory.mktemp("text")), val_percent=5)


@pytest.fixture(scope="session")
def text_data_wide_val(tmp_path_factory):
    """The small token file with a 20 % /val (~32 K tokens, 5 documents): the evaluation the
    convergence targets and their margins were measured on."""
    return make_text_file(str(tmp_path_factory.mktemp("text-wide-val")), val_percent=20)


@pytest.fixture(scope="session")
def mpi_text_data(mpi_shared_dir):
    """The small token file with a 5 % /val (~6 K tokens), written by rank 0 and visible to all ranks.
    A run's final evaluation scores the whole /val: at 20 % (32 K tokens) it was half of these
    tests' time, and what they compare (one run's scores with another's) needs only some windows."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank == 0:
        make_text_file(mpi_shared_dir, val_percent=5)
    MPI.COMM_WORLD.Barrier()
    return os.path.join(mpi_shared_dir, "text.h5")


SMALL_VOCAB = 16   # more ids than the simulator's 2-block grids: their grid-stride loops still iterate


@pytest.fixture(scope="session")
def mpi_small_vocab_text(mpi_text_data, mpi_shared_dir):
    """:func:`mpi_text_data` with every token folded into :data:`SMALL_VOCAB` (t mod 16), written by
    rank 0 once per job; its path, on every rank. For GPT runs on the simulator, which interprets
    every CUDA thread: the vocabulary sizes a step's costliest launches (the tied head's GEMMs, the
    embedding's gradient) without changing what runs (on the 256 byte values a one-block step took
    1.8 times as long)."""
    import h5py
    from mpi4py import MPI

    path = os.path.join(mpi_shared_dir, f"text-vocab{SMALL_VOCAB}.h5")
    if MPI.COMM_WORLD.rank == 0 and not os.path.exists(path):
        with h5py.File(mpi_text_data, "r") as src, h5py.File(path + ".tmp", "w") as out:
            for split in ("train", "val"):
                out[split] = src[split][:] % SMALL_VOCAB
            out.attrs.update({"format": "hpctrain-tokens", "format_version": 1, "vocab_size": SMALL_VOCAB})
        os.replace(path + ".tmp", path)
    MPI.COMM_WORLD.Barrier()
    return path


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """(train, eval) paths of small synthetic sets, made once per serial session."""
    folder = str(tmp_path_factory.mktemp("data"))
    return make_small_dataset(folder), make_small_dataset(folder, n=512, seed=2, name="eval.h5")


@pytest.fixture(scope="session")
def mpi_shared_dir():
    """A directory every rank sees: made by rank 0, its path broadcast; removed at the end."""
    import shutil

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = tempfile.mkdtemp(prefix="hpctrain-mpi-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


_FRESH_ROOT = []  # the per-job folder of fresh_shared_dir, removed by rank 0 at exit


def fresh_shared_dir(world, tag: str) -> str:
    """An empty folder named ``tag`` that every rank of ``world`` sees (collective), inside one
    per-job temporary folder that rank 0 removes when the job exits (so repeated runs leave
    nothing in /tmp; ``HPCTRAIN_TEST_TMP`` moves it, e.g. onto a parallel file system)."""
    import atexit
    import shutil

    if not _FRESH_ROOT:
        root = None
        if world.rank == 0:
            root = tempfile.mkdtemp(prefix="hpctrain-ckpt-", dir=os.environ.get("HPCTRAIN_TEST_TMP"))
            atexit.register(shutil.rmtree, root, True)
        _FRESH_ROOT.append(world.comm.bcast(root, root=0))
    path = os.path.join(_FRESH_ROOT[0], tag)
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    world.comm.Barrier()
    return path


@pytest.fixture(scope="session")
def mpi_small_data(mpi_shared_dir):
    """(train, eval) small datasets written by rank 0 and visible to all ranks."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        make_small_dataset(mpi_shared_dir)
        make_small_dataset(mpi_shared_dir, n=512, seed=2, name="eval.h5")
    comm.Barrier()
    return os.path.join(mpi_shared_dir, "train.h5"), os.path.join(mpi_shared_dir, "eval.h5")


@functools.lru_cache(maxsize=None)
def _open_mpi() -> bool:
    """True when ``mpirun`` is Open MPI's (the only one that knows ``--oversubscribe``; MPICH's
    Hydra, on a GPU machine with pip's MPI say, runs more ranks than cores without it)."""
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return True
    return "Open MPI" in out or "OpenRTE" in out


def run_mpi(n: int, args: list[str], timeout: float = 120, cwd: str = REPO, env_extra=None):
    """Launch ``mpirun -n n python <args>`` and return the CompletedProcess (text).

    A timeout raises subprocess.TimeoutExpired (after killing the job), so a
    hang fails the test instead of blocking the suite.
    """
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    cmd = ["mpirun", "-n", str(n), *(["--oversubscribe"] if _open_mpi() else []), sys.executable, *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# the local SLURM cluster of the tests marked slurm (session scope; tests/slurm_cluster.py)
from slurm_cluster import slurm_cluster  # noqa: E402,F401

"""``python -m hpctrain info``: what each rank sees, gathered and printed by rank 0."""

from __future__ import annotations

import os
import socket


def _libraries() -> dict:
    """Versions and capabilities that matter for a run (same on every rank of a node)."""
    from mpi4py import MPI

    out = {"MPI library": MPI.Get_library_version().rstrip("\x00").splitlines()[0].strip(),
           "MPI standard": "%d.%d" % MPI.Get_version(),
           "MPI thread level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                                MPI.THREAD_SERIALIZED: "serialized",
                                MPI.THREAD_MULTIPLE: "multiple"}[MPI.Query_thread()]}
    try:
        import h5py

        out["h5py"] = f"{h5py.__version__} (HDF5 {h5py.version.hdf5_version}, mpi={h5py.get_config().mpi})"
    except ImportError as exc:
        out["h5py"] = f"missing ({exc}); run scripts/setup.sh"
    import numba
    import numpy

    out["numpy"] = numpy.__version__
    out["numba"] = numba.__version__
    from ..comm.staging import cuda_aware_mpi

    aware, how = cuda_aware_mpi()
    out["CUDA-aware MPI"] = f"{'yes' if aware else 'no'} ({how})"
    return out


def _device_choice(local_rank: int) -> tuple[str, str, str]:
    """(what train.device=auto gives this rank, its GEMMs under train.gemm=auto, CUDA status line)
    without creating a CUDA context: CuPy is imported, not run (a cuBLAS that fails to load
    shows at training start-up, as the device's warning)."""
    from ..device import cuda_status, gpu_for_rank, gpu_name, simulated
    from ..kernels.support.cublas import cupy_found

    n, why = cuda_status()
    if simulated():
        return ("cpu (auto never picks the simulator; device=cuda uses it)",
                "numpy BLAS; numba (simulator) with device=cuda", "numba CUDA simulator")
    if n == 0:
        return "cpu", "numpy BLAS", f"no GPU ({why})"
    gpu = gpu_for_rank(local_rank, n)
    version, no_cupy = cupy_found()
    gemm = f"cublas (CuPy {version})" if version else f"numba ({no_cupy})"
    return f"cuda:{gpu} {gpu_name(gpu)}", gemm, f"{n} GPU(s) visible"


def _threads() -> dict:
    """The rank's binding and thread counts as info's columns (runtime.binding)."""
    from ..runtime import binding, oversubscribed_note

    bound = binding()
    return {"cpus": f"{bound['cpus']} ({bound['cores']})", "threads ops/BLAS/numba":
            f"{bound['ops']}/{bound['blas']}/{bound['numba']}", "note": oversubscribed_note(bound)}


def print_info(world) -> None:
    """Collective: every rank reports; rank 0 prints a table in rank order."""
    from ..reliability import slurm

    device, gemm, cuda_line = _device_choice(world.local_rank)
    job = slurm.current()
    mine = {"rank": world.rank, "host": socket.gethostname(), "pid": os.getpid(),
            "local": f"{world.local_rank}/{world.local_size}", "node": f"{world.node_rank}/{world.n_nodes}",
            "device": device, "GEMM": gemm, "CUDA": cuda_line,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
            **_threads(),
            "slurm_job": job.tag if job else "-", "slurm_node": (job and job.node_name) or "-"}
    rows = world.comm.gather(mine, root=0)
    libs = _libraries() if world.is_root else None
    if not world.is_root:
        return
    from .. import __version__

    print(f"hpctrain {__version__}: {world.size} rank(s), {world.n_nodes} node(s)")
    if job:
        print(f"  {slurm.describe(job)}")
    for key, value in libs.items():
        print(f"  {key:<17} {value}")
    cols = ["rank", "host", "pid", "local", "node", "device", "GEMM", "CUDA", "CUDA_VISIBLE_DEVICES", "cpus",
            "threads ops/BLAS/numba", "slurm_job", "slurm_node"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  " + "  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  " + "  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    crowded = [r for r in rows if r["note"]]
    if crowded:
        print(f"  threads: rank(s) {','.join(str(r['rank']) for r in crowded)}: {crowded[0]['note']}")
    slow = [str(r["rank"]) for r in rows if r["GEMM"].startswith("numba (")]
    if slow:
        from ..kernels.support.cublas import CUPY_FIX

        print(f"  GEMM: rank(s) {','.join(slow)} would run the numba GEMM kernels on a GPU (train.gemm = auto); "
              f"to fix: {CUPY_FIX}")

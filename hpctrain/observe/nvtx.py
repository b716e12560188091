"""NVTX ranges for Nsight Systems (``train.nvtx = true``).

``nsys profile -t cuda,nvtx,mpi srun python -m hpctrain train --set train.nvtx=true ...`` shows,
on each rank's main thread, a range per step (``step N``), per phase inside it (data, forward,
backward, allreduce (the exposed wait), optimizer, allgather) and per layer or block
(``forward h.3``, ``backward h.3``), and on the communication thread one per bucket reduced
(``comm bucket i``), above the CUDA kernels and MPI calls they queued. Unlike ``train.trace``,
nothing waits for the GPU: the ranges mark when the host issued the work, and Nsight draws
the kernels on the GPU's own timeline beneath them.

Ranges come from CuPy's NVTX bindings (``cupy.cuda.nvtx``: push and pop, per thread). Off (the
default) the trainer holds no ranges object and every hook is one ``if ... is not None``.
"""

from __future__ import annotations

from contextlib import contextmanager


def _bindings():
    """(push(name), pop()) from CuPy's NVTX module; raises ConfigError naming the fix without it."""
    from ..errors import ConfigError

    try:
        from cupy.cuda import nvtx
    except Exception as exc:  # noqa: BLE001 - missing, or a CuPy that cannot load its CUDA libraries
        raise ConfigError(f"train.nvtx = true needs CuPy's NVTX bindings (cupy.cuda.nvtx), which do not import "
                          f"({type(exc).__name__}: {exc}): install CuPy (bash scripts/setup.sh on a GPU node) "
                          f"or set train.nvtx = false") from None
    if not getattr(nvtx, "available", True):   # CuPy built without NVTX
        raise ConfigError("train.nvtx = true, but this CuPy was built without NVTX (cupy.cuda.nvtx.available is "
                          "False): install a CuPy wheel with NVTX, or set train.nvtx = false")
    return nvtx.RangePush, nvtx.RangePop


class NvtxRanges:
    """Push/pop NVTX ranges; ``with ranges(name): ...`` is one range."""

    def __init__(self, push, pop):
        self.push, self.pop = push, pop

    @contextmanager
    def __call__(self, name: str):
        self.push(name)
        try:
            yield
        finally:
            self.pop()


def make_ranges(enabled: bool) -> NvtxRanges | None:
    """The run's ranges when ``train.nvtx`` is on, else None."""
    return NvtxRanges(*_bindings()) if enabled else None

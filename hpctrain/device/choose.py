"""Which device a rank computes on: ``train.device`` (auto, cpu, cuda) and the GPUs this node shows."""

from __future__ import annotations

import os

from .cpu import CpuDevice
from .cuda import CudaDevice, simulated


def _driver_loads() -> bool:
    """False when no CUDA driver library can be loaded from any place numba-cuda looks (the loader's
    path, /usr/lib, /usr/lib64): then numba.cuda finds no GPU either, and a CPU run need not import
    it (~0.6 s per rank). Where ``NUMBA_CUDA_DRIVER`` is set (older numba reads it), numba decides."""
    import ctypes

    if os.environ.get("NUMBA_CUDA_DRIVER"):
        return True
    for folder in ("", "/usr/lib", "/usr/lib64"):
        for name in ("libcuda.so", "libcuda.so.1"):
            try:
                ctypes.CDLL(os.path.join(folder, name))
                return True
            except OSError:
                continue
    return False


def cuda_status() -> tuple[int, str]:
    """(number of usable GPUs, why not when 0). The simulator counts as one GPU."""
    if not simulated() and not _driver_loads():
        return 0, "no CUDA driver library (libcuda.so.1) can be loaded"
    try:
        from numba import cuda

        if not cuda.is_available():
            return 0, "numba.cuda finds no usable GPU or driver"
        return len(cuda.gpus), ""
    except Exception as exc:  # noqa: BLE001 - a broken driver is a status, not a crash
        return 0, f"{type(exc).__name__}: {exc}"


def gpu_for_rank(local_rank: int, n_gpus: int) -> int:
    """GPU index of a rank: local_rank modulo the visible GPUs (CUDA_VISIBLE_DEVICES renumbers them)."""
    return local_rank % n_gpus


def make_device(name: str, dtype: str, world=None, gemm: str = "auto", attention: str = "auto"):
    """The device a rank computes on.

    ``auto`` is cuda when a real GPU is visible (never the simulator: it is a
    test tool, thousands of times slower than the CPU), else cpu. ``cuda``
    takes GPU ``local_rank % n_visible`` and fails clearly when there is none.
    """
    from ..errors import ConfigError

    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device={name!r}: choose auto, cpu or cuda")
    if name == "cpu":
        return CpuDevice(dtype)
    if name == "auto" and simulated():
        return CpuDevice(dtype)
    n_gpus, why = cuda_status()
    if name == "auto" and n_gpus == 0:
        return CpuDevice(dtype)
    if n_gpus == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ConfigError(f"train.device='cuda' but no GPU is usable{hint}: {why}; "
                          f"use train.device='auto' or 'cpu', or run on a GPU node")
    local_rank = world.local_rank if world is not None else 0
    return CudaDevice(dtype, gpu_for_rank(local_rank, n_gpus), gemm, attention)

"""The device seam: who owns array memory, host<->device copies and the kernel table.

The rest of hpctrain never asks "am I on a GPU?": layers call ``device.ops.<op>`` (:mod:`.ops`,
one table for both devices) and allocate through ``device.empty`` / ``device.zeros``. Every device
offers ``name, dtype, accum_dtype, ops``; ``empty/zeros(shape)``; ``from_host(array)``;
``upload(array, slot)`` (into a buffer reused per slot; on a GPU an asynchronous copy from pinned
memory); ``copy_from_host(dst, src)``; ``to_host(array)`` (waits for the device);
``synchronize()``; ``fence`` (orders the communication thread's copies against the device's queue,
:mod:`.transfers`); ``launches()``; ``describe()``; ``gemm_note`` (a warning to log once, or None).
A :class:`MixedDevice` computes over a float32 device in bf16 or fp16 (``train.precision``).
"""

from .choose import cuda_status, gpu_for_rank, make_device
from .cpu import CPU_OPS, CpuDevice
from .cuda import CudaDevice, gemm_backend, gemm_fallback_warning, gpu_name, simulated
from .mixed import MixedDevice, on_device

__all__ = ["CPU_OPS", "CpuDevice", "CudaDevice", "MixedDevice", "cuda_status", "gemm_backend",
           "gemm_fallback_warning", "gpu_for_rank", "gpu_name", "make_device", "on_device", "simulated"]

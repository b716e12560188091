"""The CUDA device (numba device arrays on one GPU, one stream), and what a GPU run chooses at
start-up: its GEMMs (``train.gemm``: numba's kernels or cuBLAS through CuPy) and its attention
(``model.attention``: the flash kernels or batched GEMMs, :mod:`hpctrain.kernels.attention`)."""

from __future__ import annotations

import copy
import functools
import math
from types import SimpleNamespace

import numpy as np

from ..kernels import attention
from ..kernels.support import cuda_support
from .ops import CUBLAS_GEMMS, GEMM_OPS, OPS, cuda_ops
from .transfers import PinnedUpload, StreamFence


class CudaDevice:
    """numba device arrays on one GPU; every kernel and copy is queued on one stream.

    Creating it selects the GPU (and so creates its CUDA context); nothing
    happens at import time. Under numba's CUDA simulator it runs as it is: the simulator's fixes
    for concurrent launches are a test tool (hpctrain.testing.simulator), applied by the tests.
    """

    name = "cuda"

    def __init__(self, dtype="float32", gpu: int = 0, gemm: str = "numba", attention: str = "flash"):
        from numba import cuda

        self._cuda = cuda
        self.dtype = np.dtype(dtype)
        self.accum_dtype = self.dtype   # what ops save in full precision (hpctrain.precision)
        self.gpu = gpu
        cuda.select_device(gpu)
        self.stream = cuda.stream()
        self.fence = StreamFence(cuda, self.stream)
        self._scratch: dict = {}
        self._uploads: dict = {}
        self.gemm, why = gemm_backend(gemm, gpu)
        self.gemm_note = gemm_fallback_warning(gemm, self.gemm == "cublas", simulated(), why, gpu)
        self.ops = cuda_ops(self.stream, self.scratch)
        self.attention = attention
        self._install_gemms()

    def _install_gemms(self):
        """The GEMM ops of ``self.gemm``: cuBLAS through CuPy, or the numba kernels."""
        if self.gemm == "cublas":
            from ..kernels.support.cublas import CublasGemm

            cublas = CublasGemm(self.stream, self.gpu)
            for op, launcher in CUBLAS_GEMMS.items():
                setattr(self.ops, op, functools.partial(launcher, cublas=cublas))
        else:
            for op in GEMM_OPS:
                setattr(self.ops, op, functools.partial(OPS[op].cuda, stream=self.stream))
        self._install_attention()

    def _install_attention(self):
        """The attention ops of ``self.attention`` (model.attention): flash kernels, batched GEMMs
        (cuBLAS; NumPy on the simulator), or per shape. The GEMM path needs cuBLAS on a GPU."""
        from ..errors import ConfigError
        from ..kernels.attention import gemm as attention_gemm
        from ..kernels.support import batched_gemm

        self.attention_note = None
        if self.gemm == "cublas":
            gemms, why = None, ""
            if self.attention != "flash":
                try:
                    gemms = batched_gemm.CublasBatchedGemm(self.stream, self.gpu)
                    why = attention_gemm.self_check(gemms, self.stream, self.scratch, self.dtype)
                except Exception as exc:  # noqa: BLE001 - a cuBLAS or CuPy failure: flash only, or the error
                    why = f"the cuBLAS attention failed its start-up check ({type(exc).__name__}: {exc})"
            if why and self.attention == "gemm":
                raise ConfigError(f"model.attention='gemm': {why}; use model.attention='flash'")
            if why:  # auto: the flash kernels only, said once at start-up
                gemms, self.attention_note = None, f"model.attention = auto uses the flash kernels only: {why}"
        elif simulated():
            gemms = batched_gemm.HostBatchedGemm()
        elif self.attention == "gemm":
            raise ConfigError("model.attention='gemm' runs its GEMMs on cuBLAS, but this run's GEMMs are numba's "
                              f"(train.gemm = {self.gemm}): use train.gemm='auto' or 'cublas' with CuPy, or "
                              "model.attention='flash'")
        else:
            gemms = None
        chosen = attention.ChosenAttention(self.attention, self.stream, self.scratch,
                                           None if self.attention == "flash" else gemms)
        self.ops.attention_forward, self.ops.attention_backward = chosen.forward, chosen.backward
        # the flash kernels' head-size limit binds only where they are the only path
        self.ops.attention_max_head_size = attention.HS_SIZES[-1] if chosen.gemm is None else None

    def with_gemm(self, choice: str) -> "CudaDevice":
        """This device (same GPU, stream, scratch and uploads) with ``train.gemm = choice``'s
        GEMMs: one benchmark can time the numba kernels and a model on cuBLAS side by side."""
        twin = copy.copy(self)
        twin.ops = SimpleNamespace(**vars(self.ops))
        twin.gemm, why = gemm_backend(choice, self.gpu)
        twin.gemm_note = gemm_fallback_warning(choice, twin.gemm == "cublas", simulated(), why, self.gpu)
        twin._install_gemms()
        return twin

    def empty(self, shape, dtype=None):
        return self._cuda.device_array(shape, dtype=dtype or self.dtype, stream=self.stream)

    def zeros(self, shape, dtype=None):
        dtype = dtype or self.dtype
        return self.from_host(np.zeros(shape, dtype), dtype)   # from_host alone would cast to self.dtype

    def from_host(self, array, dtype=None):
        return self._cuda.to_device(np.ascontiguousarray(array, dtype=dtype or self.dtype), stream=self.stream)

    def upload(self, array, slot, dtype=None):
        """``array`` copied into a device buffer kept for (slot, shape, dtype) and reused: the same
        buffer every time (a CUDA graph may read it), filled by an asynchronous copy on the
        stream from one of two pinned host buffers taken in turn. The host waits only when the
        pinned buffer it takes is still being read by its copy of two uploads ago."""
        host = np.asarray(array, dtype=dtype or self.dtype)
        key = (slot, host.shape, host.dtype.str)
        entry = self._uploads.get(key)
        if entry is None:
            entry = self._uploads[key] = PinnedUpload(self._cuda, self.empty(host.shape, host.dtype))
        return entry.send(host, self.stream)

    def copy_from_host(self, dst, src):
        dst.copy_to_device(np.ascontiguousarray(src, dtype=dst.dtype), stream=self.stream)

    def to_host(self, array):
        host = array.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return host

    def synchronize(self):
        self.stream.synchronize()

    def memory_used(self) -> int | None:
        """Bytes in use on this GPU (total minus free: every process's, as nvidia-smi shows); None
        where that is not known (the simulator answers NaN)."""
        free, total = self._cuda.current_context().get_memory_info()
        used = total - free
        return int(used) if math.isfinite(used) else None

    def release_freed(self) -> None:
        """Free now the device memory of arrays already dropped (numba defers it to a batch), e.g. the
        whole gradient buffer that ZeRO-2's slots replace; the simulator keeps no such list."""
        pending = getattr(self._cuda.current_context(), "deallocations", None)
        if pending is not None:
            pending.clear()

    def thread_context(self):
        """Makes this GPU current in the calling thread (the communication thread needs it)."""
        return self._cuda.gpus[self.gpu]

    def scratch(self, key, shape, dtype, zero=False):
        """A device array lent to a launcher, reused by every call with the same key and shape;
        ``zero``: zeroed when it is made (a kernel that must find it zero leaves it so).

        Safe because all work is ordered on this device's one stream.
        """
        k = (key, tuple(shape), np.dtype(dtype).str)
        buf = self._scratch.get(k)
        if buf is None:
            buf = self._scratch[k] = (self._cuda.to_device(np.zeros(shape, dtype), stream=self.stream) if zero else
                                      self._cuda.device_array(shape, dtype=dtype, stream=self.stream))
        return buf

    def can_capture(self) -> tuple[bool, str]:
        """(whether :meth:`capture` can record CUDA graphs here, why not): CuPy's stream capture on a
        real GPU."""
        if simulated():
            return False, "numba's CUDA simulator has no graphs"
        from ..kernels.support.cublas import cupy_found

        version, why = cupy_found()
        return (True, "") if version else (False, why)

    def capture(self, fn):
        """A CUDA graph of the work ``fn`` queues on this device's stream (recorded, not run; CuPy's
        stream capture in relaxed mode: numba's launches and cuBLAS's calls on the stream are
        recorded). On an error the capture is ended and discarded, and the error raised."""
        import cupy

        stream = cupy.cuda.ExternalStream(int(self.stream))
        stream.begin_capture()
        try:
            with self._cuda.defer_cleanup():  # no cuMemFree of a dropped array while capturing
                fn()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - an invalidated capture also says so here; fn's error is the one
                pass
            raise
        return stream.end_capture()

    def replay(self, graph) -> None:
        """Queue a graph from :meth:`capture` on this device's stream (one launch counted)."""
        import cupy

        cuda_support.count_launches()
        graph.launch(stream=cupy.cuda.ExternalStream(int(self.stream)))

    def launches(self) -> int:
        """Host-side launches so far (kernels, cuBLAS calls, graph replays; every thread's)."""
        return cuda_support.launches()

    def describe(self) -> str:
        return (f"cuda:{self.gpu} ({gpu_name(self.gpu)}, {self.dtype.name}, GEMM {self.gemm}, "
                f"attention {self.attention})")


# ---- what the GPU's run uses ---------------------------------------------------------
def gemm_backend(choice: str, gpu: int = 0) -> tuple[str, str]:
    """``train.gemm`` resolved: ("cublas", "") or ("numba", why not cuBLAS). auto takes cuBLAS
    when CuPy's cuBLAS multiplies on GPU ``gpu`` (never on the simulator, which CuPy cannot run
    on); cublas without it is a ConfigError."""
    from ..errors import ConfigError

    if choice not in ("auto", "numba", "cublas"):
        raise ConfigError(f"train.gemm={choice!r}: choose auto, numba or cublas")
    if choice == "numba":
        return "numba", "train.gemm = numba"
    if choice == "auto" and simulated():
        return "numba", "the numba CUDA simulator is active"
    from ..kernels.support.cublas import CUPY_FIX, cupy_status

    ok, why = (False, "the numba CUDA simulator is active") if simulated() else cupy_status(gpu)
    if ok:
        return "cublas", ""
    if choice == "cublas":
        raise ConfigError(f"train.gemm='cublas' needs CuPy on a GPU ({why}): {CUPY_FIX}; "
                          f"or use train.gemm='numba'")
    return "numba", why


def gemm_fallback_warning(choice: str, cupy_ok: bool, on_simulator: bool, why: str = "",
                          gpu: int = 0) -> str | None:
    """The warning a cuda run logs once at start-up (rank 0) when ``train.gemm = auto`` gives the
    numba GEMMs because CuPy is missing or unusable (``why``), with the fix; None when the user
    chose numba, when cuBLAS runs, and on the simulator (where CuPy can never run)."""
    if choice != "auto" or cupy_ok or on_simulator:
        return None
    from ..kernels.support.cublas import CUPY_FIX

    return (f"train.gemm = auto: GPU {gpu} uses the numba GEMM kernels (0.21-0.34x cuBLAS's speed) because "
            f"{why or 'CuPy is unusable'}. To fix: {CUPY_FIX}. train.gemm = numba silences this.")


def simulated() -> bool:
    from ..kernels.support.cuda_support import simulated as sim

    return sim()


def gpu_name(index: int) -> str:
    if simulated():
        return "numba CUDA simulator"
    from numba import cuda

    name = cuda.gpus[index].name
    return name.decode() if isinstance(name, bytes) else str(name)

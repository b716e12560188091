"""cuBLAS through CuPy, on the device's own memory and stream: whether CuPy runs here
(:func:`cupy_found`, :func:`cupy_status`, :data:`CUPY_FIX`) and :class:`CublasGemm`, one GEMM on
numba device arrays. ``train.gemm = "cublas"`` (or ``"auto"`` where CuPy imports) runs the GEMM
ops on it: linear.py's ``*_cuda_cublas`` launchers, in the CUDA op table in place of the numba
kernels' ``*_cuda``, with the same contract.

No copies: each numba device array is wrapped as a CuPy array over the same pointer,
shape and strides; transposes are taken on the CuPy side, where ``.T`` is a view that cuBLAS
reads with its transpose flags (a numba device array's ``.T`` would be a copy). The wrap is built from the array's
``__cuda_array_interface__`` pointer rather than by ``cupy.asarray``, because CuPy, as a
consumer of that interface, would synchronise the producer's stream on every call;
everything here is queued on the one stream already. Wrappers are cached per
(pointer, shape, strides, dtype): a step reuses its buffers, so after the first step a
GEMM costs one cuBLAS call and no allocation. ``accumulate`` (gradient accumulation)
computes into a cached scratch product and adds it (one extra elementwise pass; plain
``matmul`` has no beta). TF32 stays off (CuPy's default, unless ``CUPY_TF32=1``), so
float32 products are IEEE float32 like the numba kernel's.
"""

from __future__ import annotations

import numpy as np

from .cuda_support import count_launches


# The fix, named wherever CuPy is missing or unusable; setup.cfg's gpu extra says why cupy-cuda12x
# on a CUDA 13 driver too.
CUPY_FIX = ("run `bash scripts/setup.sh` on a GPU node (it installs CuPy where nvidia-smi lists a GPU), "
            "or `pip install 'cupy-cuda12x[ctk]>=14'` into the venv")


def cupy_found() -> tuple[str, str]:
    """(CuPy's version, "") when CuPy imports and was built for a CUDA major version the driver
    runs, else ("", why not). Creates no CUDA context (``info`` calls it on every rank); a cuBLAS
    that fails to load shows only in :func:`cupy_status`."""
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            return "", "CuPy is not installed"
        return "", f"CuPy does not import ({type(exc).__name__}: {exc})"
    except Exception as exc:  # noqa: BLE001 - a broken CuPy (a missing CUDA library) is a status
        return "", f"CuPy does not import ({type(exc).__name__}: {exc})"
    try:
        # both are version queries: neither creates a context. 12080 is CUDA 12.8
        built, driver = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
    except Exception as exc:  # noqa: BLE001
        return "", f"CuPy {cupy.__version__} cannot load its CUDA runtime ({type(exc).__name__}: {exc})"
    if built // 1000 > driver // 1000:
        return "", (f"CuPy {cupy.__version__} is built for CUDA {built // 1000}, the driver runs CUDA "
                    f"{driver // 1000}.{driver % 1000 // 10}")
    return cupy.__version__, ""


def cupy_status(gpu: int = 0) -> tuple[bool, str]:
    """(whether CuPy imports and its cuBLAS multiplies on GPU ``gpu``, why not). Creates the
    context on ``gpu``: the device calls it when it is made."""
    version, why = cupy_found()
    if not version:
        return False, why
    try:
        import cupy

        with cupy.cuda.Device(gpu):  # on the rank's own GPU: no context on GPU 0 for every rank
            a = cupy.ones((2, 2), cupy.float32)
            if float((a @ a)[0, 0]) != 2.0:  # loads cuBLAS: a broken install fails here, not at step 1
                return False, f"CuPy {version}'s cuBLAS gave a wrong product"
        return True, ""
    except Exception as exc:  # noqa: BLE001 - a missing or broken cuBLAS is a status
        return False, f"CuPy {version} cannot multiply on GPU {gpu} ({type(exc).__name__}: {exc})"


def _c_strides(shape, itemsize):
    """Byte strides of a C-contiguous array (the interface omits them for one)."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


class CublasGemm:
    """cuBLAS's GEMM on numba device arrays, queued on one device stream (a numba ``cuda.stream()``)."""

    def __init__(self, stream, gpu: int = 0):
        import cupy

        cupy.cuda.Device(gpu).use()  # the rank's GPU (numba selected it; CuPy keeps its own current device)
        self.cp = cupy
        self.stream = cupy.cuda.ExternalStream(int(stream))  # numba's Stream converts to its CUstream handle
        self._views: dict = {}
        self._scratch: dict = {}

    def view(self, a):
        """A CuPy array over ``a``'s device memory (no copy, no synchronisation)."""
        cai = a.__cuda_array_interface__
        ptr = cai["data"][0]
        dtype = np.dtype(cai["typestr"])
        strides = cai.get("strides") or _c_strides(cai["shape"], dtype.itemsize)
        key = (ptr, tuple(cai["shape"]), tuple(strides), dtype.str)
        v = self._views.get(key)
        if v is None:
            cp = self.cp
            span = sum((n - 1) * s for n, s in zip(cai["shape"], strides)) + dtype.itemsize if a.size else 0
            # owner=a keeps the numba array (and so the pointer) alive while the view is cached, so a
            # cached key never names freed memory; the trainer's buffers live for the run anyway
            mem = cp.cuda.UnownedMemory(ptr, span, owner=a)
            v = self._views[key] = cp.ndarray(cai["shape"], dtype, cp.cuda.MemoryPointer(mem, 0), strides)
        return v

    def gemm(self, a, b, c, trans_a=False, trans_b=False, accumulate=False):
        """c <- (c +) op(a) @ op(b), all three numba device arrays; op transposes when its flag is set."""
        cp = self.cp
        A, B, C = self.view(a), self.view(b), self.view(c)
        A, B = A.T if trans_a else A, B.T if trans_b else B
        count_launches(2 if accumulate else 1)   # the GEMM, and CuPy's add of it into c
        with self.stream:
            if accumulate:
                key = (C.shape, C.dtype.str)
                tmp = self._scratch.get(key)
                if tmp is None:
                    tmp = self._scratch[key] = cp.empty(C.shape, C.dtype)
                cp.matmul(A, B, out=tmp)
                C += tmp
            else:
                cp.matmul(A, B, out=C)
        return c

"""Strided-batched GEMMs over row-major buffers: cuBLAS on a GPU, NumPy on the simulator.

A :class:`GemmBatch` names, in row-major terms, ``batch`` products inside three flat buffers:

    C[i] <- alpha * op(A[i]) @ op(B[i]) + beta * C[i]          i = 0 .. batch - 1

C[i] is an (m, n) matrix starting ``off_c + i * stride_c`` elements into ``c``, its rows ``ldc``
elements apart; A[i] is (m, k), or (k, m) stored when ``trans_a`` (likewise B[i]). Everything counts
elements, so a head's (T, hs) slice of a (B, T, 3C) qkv buffer is a matrix with ld 3C, the next head
``hs`` further on: attention's GEMMs over a batch row's heads are one call, with no copy.
:func:`cublas_arguments` turns that into cuBLAS's column-major call (a row-major matrix read
column-major is its transpose, so C^T = op(B)^T op(A)^T: operands and m, n swap). Executors:
:class:`CublasBatchedGemm` (``cublas{S,D}gemmStridedBatched`` through CuPy on the device's stream;
float32 or float64, TF32 off) and :class:`HostBatchedGemm` (NumPy on the simulator's device arrays,
whose memory the host sees: a simulated run takes every step of the real path but the cuBLAS call).
Each counts one launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cuda_support import count_launches


@dataclass(frozen=True)
class GemmBatch:
    """One strided-batched GEMM in row-major terms (see the module docstring)."""

    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    ldc: int
    off_a: int
    off_b: int
    off_c: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int
    alpha: float = 1.0
    beta: float = 0.0

    def a_shape(self):
        """(rows, columns) of each A[i] as stored."""
        return (self.k, self.m) if self.trans_a else (self.m, self.k)

    def b_shape(self):
        return (self.n, self.k) if self.trans_b else (self.k, self.n)


OP_N, OP_T = 0, 1  # cublasOperation_t


def cublas_arguments(g: GemmBatch) -> dict:
    """The column-major cublas<t>gemmStridedBatched arguments for ``g`` (operands as offsets)."""
    return dict(transa=OP_T if g.trans_b else OP_N, transb=OP_T if g.trans_a else OP_N,
                m=g.n, n=g.m, k=g.k,
                A=("b", g.off_b), lda=g.ldb, strideA=g.stride_b,
                B=("a", g.off_a), ldb=g.lda, strideB=g.stride_a,
                C=("c", g.off_c), ldc=g.ldc, strideC=g.stride_c,
                batchCount=g.batch, alpha=g.alpha, beta=g.beta)


def _matrices(flat, offset, stride, batch, rows, cols, ld):
    """(batch, rows, cols) view of a flat host array (writes go through to it)."""
    s = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], (batch, rows, cols), (stride * s, ld * s, s))


def host_gemm(g: GemmBatch, a, b, c):
    """``g`` on flat host arrays (NumPy's matmul; the reference for tests and the simulator)."""
    A = _matrices(a, g.off_a, g.stride_a, g.batch, *g.a_shape(), g.lda)
    B = _matrices(b, g.off_b, g.stride_b, g.batch, *g.b_shape(), g.ldb)
    C = _matrices(c, g.off_c, g.stride_c, g.batch, g.m, g.n, g.ldc)
    prod = np.matmul(A.swapaxes(1, 2) if g.trans_a else A, B.swapaxes(1, 2) if g.trans_b else B)
    if g.alpha != 1.0:
        prod *= c.dtype.type(g.alpha)
    if g.beta == 0.0:
        C[...] = prod
    else:
        C[...] = c.dtype.type(g.beta) * C + prod


def _check_span(g: GemmBatch, a, b, c):
    """Every matrix of the batch lies inside its buffer (cuBLAS would read or write past it)."""
    for name, buf, off, stride, (rows, cols), ld in (
            ("A", a, g.off_a, g.stride_a, g.a_shape(), g.lda), ("B", b, g.off_b, g.stride_b, g.b_shape(), g.ldb),
            ("C", c, g.off_c, g.stride_c, (g.m, g.n), g.ldc)):
        if ld < cols:
            raise ValueError(f"batched gemm: {name}'s leading dimension {ld} < its {cols} columns")
        last = off + (g.batch - 1) * stride + (rows - 1) * ld + cols
        if off < 0 or last > buf.size:
            raise ValueError(f"batched gemm: {name} spans elements {off}..{last} of a buffer of {buf.size}")


class HostBatchedGemm:
    """:class:`GemmBatch` products on device arrays whose memory the host can see: the numba
    simulator's. ``np.asarray`` of a simulated device array shares its memory."""

    name = "host"

    def __call__(self, g: GemmBatch, a, b, c):
        host = [np.asarray(x) for x in (a, b, c)]
        if not all(h.flags.c_contiguous for h in host):
            raise ValueError("batched gemm: the buffers must be C-contiguous")
        flat = [h.reshape(-1) for h in host]  # views: the products land in the device arrays
        _check_span(g, *flat)
        count_launches()   # cuBLAS's one call, as on a GPU
        host_gemm(g, *flat)


class CublasBatchedGemm:
    """:class:`GemmBatch` products by cuBLAS on numba device arrays, queued on ``stream``."""

    name = "cublas"

    def __init__(self, stream, gpu: int = 0):
        import cupy
        from cupy.cuda import cublas

        cupy.cuda.Device(gpu).use()
        self.cp, self.cublas = cupy, cublas
        self.stream = cupy.cuda.ExternalStream(int(stream))
        self.handle = cupy.cuda.device.get_cublas_handle()
        cublas.setPointerMode(self.handle, getattr(cublas, "CUBLAS_POINTER_MODE_HOST", 0))  # alpha, beta: host scalars
        self._scalars = {}

    def _scalar(self, value, dtype):
        """A host scalar kept alive for cuBLAS's host pointer mode (read when the call is made)."""
        key = (float(value), dtype.str)
        s = self._scalars.get(key)
        if s is None:
            s = self._scalars[key] = np.array([value], dtype)
        return s.ctypes.data

    def __call__(self, g: GemmBatch, a, b, c):
        dtype = np.dtype(c.dtype)
        if not (a.dtype == b.dtype == dtype) or dtype not in (np.float32, np.float64):
            raise ValueError(f"batched gemm: float32 or float64 operands of one dtype, not "
                             f"{a.dtype}, {b.dtype}, {c.dtype}")
        if not all(x.is_c_contiguous() for x in (a, b, c)):
            raise ValueError("batched gemm: the buffers must be C-contiguous")
        _check_span(g, a, b, c)
        ptr = {name: x.__cuda_array_interface__["data"][0] for name, x in (("a", a), ("b", b), ("c", c))}
        args = cublas_arguments(g)
        call = self.cublas.sgemmStridedBatched if dtype == np.float32 else self.cublas.dgemmStridedBatched
        size = dtype.itemsize
        count_launches()
        with self.stream:  # CuPy sets the handle's stream to its current one on each call
            call(self.handle, args["transa"], args["transb"], args["m"], args["n"], args["k"],
                 self._scalar(g.alpha, dtype),
                 ptr[args["A"][0]] + args["A"][1] * size, args["lda"], args["strideA"],
                 ptr[args["B"][0]] + args["B"][1] * size, args["ldb"], args["strideB"],
                 self._scalar(g.beta, dtype),
                 ptr[args["C"][0]] + args["C"][1] * size, args["ldc"], args["strideC"], args["batchCount"])

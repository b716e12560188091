"""Causal attention on CUDA as batched GEMMs around a scale-mask-softmax kernel (``model.attention = gemm``).

The contract is :mod:`.flash`'s (qkv (B, T, 3C), out (B, T, C), lse (B, NH, T) kept
between forward and backward, one float dtype), so a model switches between this and the
flash kernels per shape with nothing else changed. Here the T x T scores are materialised,
per chunk of G heads at a time, in two scratch buffers of (G, T, T) (S/P and dP/dS):
2 G T^2 itemsize bytes, at most SCORES_BUDGET (256 MiB) unless one head alone needs more
(G = 1); GPT-2 small's T = 1024 in float32 takes 8 MiB a head. Per chunk:

forward   S = Q K^T (GEMM); P = softmax(scale S, causal), lse (rows kernel); Y = P V (GEMM)
backward  S = Q K^T again (GEMM; the lse makes P without a second reduction:
          P = exp(scale S - lse), masked 0); dV = P^T dY, dP = dY V^T (GEMMs);
          dS = scale P (dP - rowsum(P dP)) (rows kernel); dQ = dS K, dK = dS^T Q (GEMMs)

Each GEMM is one strided-batched call (:mod:`..support.batched_gemm`): a chunk is G heads of one
batch row (the heads sit hs apart in qkv) or one head of G batch rows (T 3C apart), whichever
needs fewer calls. The GEMMs compute the masked upper triangle too (half their flops), which
the softmax zeroes. cuBLAS runs them on a GPU; on the numba simulator NumPy does, on the
same buffers, so the tests take this whole path but the cuBLAS call.
"""

from __future__ import annotations

import math

import numpy as np

from ..support.batched_gemm import GemmBatch
from ..support.cuda_support import blocks_for, configured
from ..support.lazy_import import lazy_import
from .flash import attention_backward_cuda, attention_forward_cuda, check_operands

kernels = lazy_import(f"{__package__}.gemm_cuda")  # the CUDA kernels launched here (imported at the first launch)

SCORES_BUDGET = 256 * 2 ** 20   # bytes of the two (G, T, T) score buffers together
def chunk_plan(B: int, NH: int, T: int, itemsize: int, budget: int = SCORES_BUDGET) -> tuple[str, int]:
    """("heads", G): batch G heads of one batch row per call, or ("rows", G): G batch rows of one
    head; G as large as ``budget`` allows, the axis the one needing fewer calls."""
    cap = max(1, budget // (2 * T * T * itemsize))
    g_heads, g_rows = min(NH, cap), min(B, cap)
    if B * -(-NH // g_heads) <= NH * -(-B // g_rows):
        return "heads", g_heads
    return "rows", g_rows


def _chunks(B, NH, along, G):
    """(b, h, n): n heads from h of row b ("heads"), or n rows from b of head h ("rows")."""
    if along == "heads":
        for b in range(B):
            for h in range(0, NH, G):
                yield b, h, min(G, NH - h)
    else:
        for h in range(NH):
            for b in range(0, B, G):
                yield b, h, min(G, B - b)


# ---- launchers ---------------------------------------------------------------------
class _Plan:
    """One call's shapes, chunking, offsets and scratch (shared by forward and backward)."""

    def __init__(self, op, qkv, n_head, arrays, scratch, budget, need_dscores):
        B, T, C3 = qkv.shape
        self.hs = check_operands(op, qkv, n_head, arrays, any_head_size=True)
        self.B, self.T, self.C3, self.C, self.NH = B, T, C3, C3 // 3, n_head
        dt = np.dtype(qkv.dtype)
        self.dtype, self.scale = dt, dt.type(1.0 / math.sqrt(self.hs))
        self.along, self.G = chunk_plan(B, n_head, T, dt.itemsize, budget)
        self.S = scratch("attention_scores", (self.G, T, T), dt)
        self.W = scratch("attention_dscores", (self.G, T, T), dt) if need_dscores else None
        self.kernels = kernels.row_kernels(dt.name, kernels.row_threads())

    def chunks(self):
        """(b, h, n, q offset, out offset, qkv stride, out stride) per chunk."""
        T, C3, C, hs = self.T, self.C3, self.C, self.hs
        heads = self.along == "heads"
        sq, so = (hs, hs) if heads else (T * C3, T * C)
        for b, h, n in _chunks(self.B, self.NH, self.along, self.G):
            yield b, h, n, b * T * C3 + h * hs, b * T * C + h * hs, sq, so

    def lse_rows(self, lse, b, h, n):
        """The chunk's (n, T) rows of the (B, NH, T) lse: n heads of row b, or head h of n rows."""
        return lse[b, h:h + n] if self.along == "heads" else lse[b:b + n, h]

    def scores(self, off_q, sq, n):
        """S[g] = Q[g] K[g]^T (T x T)."""
        T, C3 = self.T, self.C3
        return GemmBatch(T, T, self.hs, False, True, C3, C3, T, off_q, off_q + self.C, 0, sq, sq, T * T, n)


def attention_forward_cuda_gemm(qkv, n_head, out, lse, *, stream=0, scratch, gemm, budget=SCORES_BUDGET):
    """As :func:`.flash.attention_forward_cuda` (the same out and lse), by GEMMs.
    ``scratch`` is the device's (key, shape, dtype) -> reused array; ``gemm`` a
    :mod:`..support.batched_gemm` executor on the same stream."""
    B, T, C3 = qkv.shape
    p = _Plan("attention_forward_cuda_gemm", qkv, n_head, [("out", out, (B, T, C3 // 3)), ("lse", lse, (B, n_head, T))],
              scratch, budget, False)
    if B == 0 or T == 0:
        return out
    softmax_rows = p.kernels[0]
    threads = kernels.row_threads()
    for b, h, n, oq, oo, sq, so in p.chunks():
        gemm(p.scores(oq, sq, n), qkv, qkv, p.S)
        configured(softmax_rows, blocks_for(n * T, 1), threads, stream)(p.S, p.scale, p.lse_rows(lse, b, h, n), n)
        gemm(GemmBatch(T, p.hs, T, False, False, T, C3, p.C, 0, oq + 2 * p.C, oo, T * T, sq, so, n), p.S, qkv, out)
    return out


def attention_backward_cuda_gemm(dout, qkv, out, lse, n_head, dqkv, work, *, stream=0, scratch, gemm,
                            budget=SCORES_BUDGET):
    """As :func:`.flash.attention_backward_cuda` (dqkv overwritten), by GEMMs. ``out`` and
    ``work`` are unused (the row term is reduced from P and dP); they keep the flash signature."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    p = _Plan("attention_backward_cuda_gemm", qkv, n_head,
              [("dout", dout, (B, T, C)), ("lse", lse, (B, n_head, T)), ("dqkv", dqkv, qkv.shape)],
              scratch, budget, True)
    if B == 0 or T == 0:
        return dqkv
    _, probs, grad_rows = p.kernels
    threads, hs, S, W = kernels.row_threads(), p.hs, p.S, p.W
    for b, h, n, oq, oo, sq, so in p.chunks():
        gemm(p.scores(oq, sq, n), qkv, qkv, S)
        configured(probs, blocks_for(n * T * T), 256, stream)(S, p.scale, p.lse_rows(lse, b, h, n), n)
        # dV = P^T dY; dP = dY V^T
        gemm(GemmBatch(T, hs, T, True, False, T, C, C3, 0, oo, oq + 2 * C, T * T, so, sq, n), S, dout, dqkv)
        gemm(GemmBatch(T, T, hs, False, True, C, C3, T, oo, oq + 2 * C, 0, so, sq, T * T, n), dout, qkv, W)
        configured(grad_rows, blocks_for(n * T, 1), threads, stream)(S, W, p.scale, n)
        # dQ = dS K; dK = dS^T Q (dS carries the scale)
        gemm(GemmBatch(T, hs, T, False, False, T, C3, C3, 0, oq + C, oq, T * T, sq, sq, n), W, qkv, dqkv)
        gemm(GemmBatch(T, hs, T, True, False, T, C3, C3, 0, oq, oq + C, T * T, sq, sq, n), W, qkv, dqkv)
    return dqkv


def self_check(gemm, stream, scratch, dtype, shape=(2, 3, 37, 8)) -> str:
    """"" when the GEMM path computes what the flash kernels do on small cases, else what
    differed. ``shape`` = (B, NH, T, hs), by default with ragged tiles; it runs with G heads of
    a row a call, with one head a call, and (B and NH swapped) with G rows of one head a call.
    Run once when a device is made with cuBLAS's GEMMs, so that a CuPy whose cuBLAS binding reads
    its arguments differently is found at start-up instead of training on wrong attention."""
    B, NH, T, hs = shape
    for case, budget in (((B, NH, T, hs), SCORES_BUDGET), ((B, NH, T, hs), 1), ((NH, B, T, hs), SCORES_BUDGET)):
        why = _check_case(gemm, stream, scratch, dtype, case, budget)
        if why:
            return why
    return ""


def _check_case(gemm, stream, scratch, dtype, shape, budget) -> str:
    """:func:`self_check` of one shape and chunk budget."""
    from numba import cuda

    B, NH, T, hs = shape
    dt = np.dtype(dtype)
    rng = np.random.default_rng(11)
    qkv_h, dy_h = rng.standard_normal((B, T, 3 * NH * hs)).astype(dt), rng.standard_normal((B, T, NH * hs)).astype(dt)
    qkv, dy = cuda.to_device(qkv_h, stream=stream), cuda.to_device(dy_h, stream=stream)
    got = []
    for path in ("flash", "gemm"):
        out, lse = cuda.device_array((B, T, NH * hs), dt, stream=stream), cuda.device_array((B, NH, T), dt,
                                                                                          stream=stream)
        dq, work = cuda.device_array(qkv.shape, dt, stream=stream), cuda.device_array((B, NH, T), dt, stream=stream)
        if path == "flash":
            attention_forward_cuda(qkv, NH, out, lse, stream=stream)
            attention_backward_cuda(dy, qkv, out, lse, NH, dq, work, stream=stream)
        else:
            kw = dict(stream=stream, scratch=scratch, gemm=gemm, budget=budget)
            attention_forward_cuda_gemm(qkv, NH, out, lse, **kw)
            attention_backward_cuda_gemm(dy, qkv, out, lse, NH, dq, work, **kw)
        got.append([a.copy_to_host(stream=stream) for a in (out, lse, dq)])
    stream.synchronize()
    u = float(np.finfo(dt).eps)
    for name, flash, mine in zip(("out", "lse", "dqkv"), *got):
        scale = max(float(np.abs(flash).max()), 1e-30)
        err = float(np.abs(mine.astype(np.float64) - flash).max()) / scale
        if not np.isfinite(err) or err > 64 * (T + hs) * u:
            return (f"the cuBLAS attention's {name} differs from the flash kernels' by {err:.1e} of its scale on a "
                    f"test case (B {B}, NH {NH}, T {T}, hs {hs})")
    return ""

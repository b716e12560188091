"""Bias add + activation, fused: the elementwise half of a Linear layer.

forward:  z (B, O) holds x @ w; z <- z + b (the pre-activation, kept for backward); out <- act(z).
          With act "identity", ``out`` may be ``z``.
backward: dz <- dout * act'(z); db <- (db +, with ``accumulate``) the column sums of dz. ``dz``
          may be ``dout`` (each element is read before it is written).

act is "identity", "relu" (subgradient 0 at 0) or "gelu" (tanh approximation, as GPT-2 and llm.c),
evaluated as gelu(v) = v s, s = 1 / (1 + exp(-2u)), u = k (v + 0.044715 v^3), k = sqrt(2/pi): the
same function without the cancellation of 1 + tanh(u) for v < 0. Arrays keep their float dtype
(float32 stays float32: the activations are built per dtype with constants of that dtype); the
column sums accumulate in float64 (B float32 additions would lose log2(B) bits), per chunk of rows
added in chunk order, so the same bits at any thread count. The activations are plain Python functions compiled for both targets (the CUDA
kernels, :mod:`.bias_act_cuda`, and the twin's ReLU loop); the twin's GELU is one numba pass with
:func:`~.support.cpu_exp.fast_exp`, its identity a NumPy add. They live in this file because numba's
disk cache only notices edits to the file of the function it cached. Accuracy: docs/gpu.md.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import njit

from .support import cpu_threads
from .support.cpu_exp import fast_exp
from .support.cuda_support import configured, row_grid
from .support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.bias_act_cuda")  # the CUDA kernels launched here (imported at the first launch)

# ---- activations (plain Python, compiled for both targets) -------------------------
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def gelu_constants(dtype):
    """(k, c, 3c, 0.5, 1, -2) in ``dtype``: the GELU's constants, typed so float32 math stays float32."""
    t = np.dtype(dtype).type
    return t(_K), t(_C), t(3.0 * _C), t(0.5), t(1.0), t(-2.0)


@lru_cache(maxsize=None)
def activations(dtype_name: str) -> dict:
    """{"identity" | "relu" | "gelu": (act, act')} for one float dtype, constants of that dtype."""
    k, c, c3, half, one, m2 = gelu_constants(dtype_name)
    zero = np.dtype(dtype_name).type(0.0)

    def identity(v):
        return v

    def identity_grad(v):
        return one

    def relu(v):
        return v if v > zero else zero

    def relu_grad(v):
        return one if v > zero else zero

    def gelu(v):
        s = one / (one + math.exp(m2 * k * (v + c * v * v * v)))
        return v * s

    def gelu_grad(v):
        s = one / (one + math.exp(m2 * k * (v + c * v * v * v)))
        return s - m2 * v * s * (one - s) * k * (one + c3 * v * v)

    return {"identity": (identity, identity_grad), "relu": (relu, relu_grad), "gelu": (gelu, gelu_grad)}


# ---- CPU twin (numba) ---------------------------------------------------------------
# One pass per row range for every activation, the same formulas in the same dtype as the CUDA
# kernels. GELU's exp is cpu_exp.fast_exp: a float32 loop around libm's scalar expf does not
# vectorise; this one does, so the pass runs at the speed of NumPy's SIMD exp without a second
# pass over memory. Backward's column sums (the bias gradient) are float64 partial sums, one
# per chunk of cpu_threads.CHUNK_ROWS rows, each kernel call covering a range of chunks.
@njit(cache=True, nogil=True, error_model="numpy")  # no zero-divisor test: the loop vectorises
def _gelu_forward(z, b, out, K):
    """z += b; out <- gelu(z), row by row."""
    k, c, _, _, one, m2 = K
    for i in range(z.shape[0]):
        for j in range(z.shape[1]):
            v = z[i, j] + b[j]
            z[i, j] = v
            out[i, j] = v * (one / (one + fast_exp(m2 * k * (v + c * v * v * v))))


@njit(cache=True, nogil=True, error_model="numpy")  # no zero-divisor test: the loop vectorises
def _gelu_backward(dout, z, dz, partials, c0, c1, chunk_rows, K):
    """dz <- dout * gelu'(z) over chunks c0..c1 of ``chunk_rows`` rows; partials[c] (float64) <-
    chunk c's column sums of dz, rows in order. dz may be dout (each element read first)."""
    k, c, c3, _, one, m2 = K
    for ch in range(c0, c1):
        sums = partials[ch]
        for i in range(ch * chunk_rows, min(z.shape[0], (ch + 1) * chunk_rows)):
            for j in range(z.shape[1]):
                v = z[i, j]
                s = one / (one + fast_exp(m2 * k * (v + c * v * v * v)))
                d = dout[i, j] * (s - m2 * v * s * (one - s) * k * (one + c3 * v * v))
                dz[i, j] = d
                sums[j] += d


# ReLU's zero and one come in typed like the data (float32 math stays float32), as arguments rather
# than a closure's constants, so the kernels are cached on disk like the others: compiling them
# cost every MLP process about 1.5 s of start-up
@njit(cache=True, nogil=True)
def _relu_forward(z, b, out, zero):
    """z += b; out <- relu(z), row by row (activations()'s relu: NaN and -0.0 give zero)."""
    for i in range(z.shape[0]):
        for j in range(z.shape[1]):
            t = z[i, j] + b[j]
            z[i, j] = t
            out[i, j] = t if t > zero else zero


@njit(cache=True, nogil=True)
def _relu_backward(dout, z, dz, partials, c0, c1, chunk_rows, zero, one):
    """dz <- dout * relu'(z) over chunks c0..c1; partials[c] (float64) <- their column sums."""
    for ch in range(c0, c1):
        sums = partials[ch]
        for i in range(ch * chunk_rows, min(z.shape[0], (ch + 1) * chunk_rows)):
            for j in range(z.shape[1]):
                d = dout[i, j] * (one if z[i, j] > zero else zero)
                dz[i, j] = d
                sums[j] += d


@njit(cache=True, nogil=True)
def _identity_backward(dout, dz, copy, partials, c0, c1, chunk_rows):
    """dz <- dout (with ``copy``: dz is another array) over chunks c0..c1; partials[c] (float64) <-
    their column sums."""
    for ch in range(c0, c1):
        sums = partials[ch]
        for i in range(ch * chunk_rows, min(dout.shape[0], (ch + 1) * chunk_rows)):
            for j in range(dout.shape[1]):
                d = dout[i, j]
                if copy:
                    dz[i, j] = d
                sums[j] += d


# ns per element of each activation's pass on one core (a 2-core EPYC, float32): whether
# splitting an op over threads pays (cpu_threads.for_rows)
_NS_FORWARD = {"identity": 0.15, "relu": 0.3, "gelu": 1.0}
_NS_BACKWARD = {"identity": 0.15, "relu": 0.5, "gelu": 1.5}


def bias_act_forward(z, b, out, act):
    """z (B, O) += b (O,); out (B, O) <- act(z). Returns out. Rows split over the CPU threads."""
    if act not in ("identity", "relu", "gelu"):
        raise ValueError(f"activation {act!r}: choose identity, relu or gelu")
    cpu_threads.for_rows(lambda lo, hi: _forward_rows(z[lo:hi], b, out[lo:hi], act), z.shape[0], z.size,
                         ns_per_element=_NS_FORWARD[act])
    return out


def _forward_rows(z, b, out, act):
    if act == "identity":  # the plain bias add vectorises; the generic loop's per-element branch does not
        np.add(z, b, out=z)
        if out is not z and not np.shares_memory(out, z):
            out[...] = z
    elif act == "gelu":
        _gelu_forward(z, b, out, gelu_constants(z.dtype))
    else:
        _relu_forward(z, b, out, z.dtype.type(0.0))


def bias_act_backward(dout, z, dz, db, act, accumulate=False):
    """dz (B, O) <- dout * act'(z); db (O,) <- (db +) column sums of dz. Returns dz.

    The column sums are float64 partial sums over chunks of cpu_threads.CHUNK_ROWS rows, added in
    chunk order: the same bits at any thread count."""
    if act not in ("identity", "relu", "gelu"):
        raise ValueError(f"activation {act!r}: choose identity, relu or gelu")
    partials = np.zeros((cpu_threads.chunks_of(z.shape[0]), z.shape[1]))
    rows = cpu_threads.CHUNK_ROWS
    if act == "identity":
        def chunks(c0, c1):
            _identity_backward(dout, dz, dz is not dout, partials, c0, c1, rows)
    elif act == "gelu":
        K = gelu_constants(z.dtype)

        def chunks(c0, c1):
            _gelu_backward(dout, z, dz, partials, c0, c1, rows, K)
    else:
        zero, one = z.dtype.type(0.0), z.dtype.type(1.0)

        def chunks(c0, c1):
            _relu_backward(dout, z, dz, partials, c0, c1, rows, zero, one)
    cpu_threads.for_chunks(chunks, z.shape[0], z.size, ns_per_element=_NS_BACKWARD[act])
    sums = cpu_threads.add_partials(partials)
    db[...] = db + sums if accumulate else sums
    return dz


# ---- launchers ---------------------------------------------------------------------
@lru_cache(maxsize=None)
def cuda_kernels(act: str, dtype_name: str):
    """(forward, backward) CUDA kernels of ``act`` for one float dtype."""
    return kernels.bias_act_kernels(*activations(dtype_name)[act])


def _check_act(act):
    if act not in ("identity", "relu", "gelu"):
        raise ValueError(f"activation {act!r}: choose identity, relu or gelu")


def bias_act_forward_cuda(z, b, out, act, *, stream=0):
    B, O = z.shape
    _check_act(act)
    grid, threads = row_grid(B, O)
    configured(cuda_kernels(act, z.dtype.name)[0], grid, threads, stream)(z, b, out)
    return out


def partial_shape(B, O):
    """Shape of the float64 scratch ``bias_act_backward_cuda`` needs for dz (B, O)."""
    return (max(1, -(-B // kernels.ROWS_PER_BLOCK)), O)


def bias_act_backward_cuda(dout, z, dz, db, act, accumulate=False, *, stream=0, scratch):
    """As :func:`bias_act_backward`; ``scratch(key, shape, dtype, zero=False)`` lends reusable device
    arrays: the float64 partial sums, and one int32 ticket counter per column tile (zero on loan,
    and left zero by the kernel)."""
    B, O = z.shape
    _check_act(act)
    partial = scratch("bias_partial", partial_shape(B, O), np.float64)
    if partial.shape[0] > 65535:  # gridDim.y limit
        raise ValueError(f"bias_act_backward with B={B} rows exceeds {65535 * kernels.ROWS_PER_BLOCK}; "
                         f"split the batch")
    grid = (-(-O // kernels.COLS), partial.shape[0])
    counters = scratch("bias_tickets", (grid[0],), np.int32, zero=True)
    launch = configured(cuda_kernels(act, z.dtype.name)[1], grid, (kernels.COLS, kernels.LANES), stream)
    launch(dout, z, dz, partial, counters, db, bool(accumulate))
    return dz

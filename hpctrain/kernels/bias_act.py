"""Bias add + activation, fused: the elementwise half of a Linear layer.

forward:  z (B, O) holds x @ w; z <- z + b (the pre-activation, kept for
          backward); out <- act(z). With act "identity", ``out`` may be ``z``.
backward: dz <- dout * act'(z); db <- sum over rows of dz (or db += ... when
          ``accumulate``). ``dz`` may be ``dout`` (each element is read before
          it is written).
act is "identity", "relu" or "gelu" (tanh approximation, as GPT-2 and llm.c:
gelu(v) = 0.5 v (1 + tanh(u)), u = k (v + 0.044715 v^3), k = sqrt(2/pi); relu's
subgradient at 0 is 0). GELU is evaluated through the identity
0.5 (1 + tanh(u)) = s = 1 / (1 + exp(-2u)), so gelu(v) = v s and
gelu'(v) = s + 2 v s (1 - s) k (1 + 3 * 0.044715 v^2): the same function, but
without the cancellation in 1 + tanh(u) for v < 0 that costs the tanh form up
to ~1e-4 relative in float32 (and exp vectorises where tanh does not).

float32 stays float32: the activations are built per dtype with constants of
that dtype (a Python float literal would promote float32 arithmetic to
float64 in numba), so the twin and the kernels both round every step in the
array's dtype. Column sums (the bias gradient) accumulate in float64: B
additions in float32 would lose log2(B) bits, and they are cheap beside the
element pass.

The activations are plain Python functions: the CUDA kernels (bias_act_cuda.py)
compile them (``numba.cuda.jit(device=True)``), and so does the CPU twin's ReLU loop
(``numba.njit``). The twin's identity is a NumPy broadcast add (plus a column-sum
loop backward) and its GELU runs NumPy's SIMD exp between two numba passes: the
same formula in the same dtype as the kernels, only vectorised (a scalar libm
call in a loop does not vectorise). They live in this file because numba's disk
cache only notices edits to the file of the function it cached.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import njit

from . import cpu_threads

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


# ---- CPU twin (numba + NumPy) -------------------------------------------------------
@lru_cache(maxsize=None)
def _relu_cpu(dtype_name: str):
    relu, relu_grad = (njit(f) for f in activations(dtype_name)["relu"])

    @njit(nogil=True)
    def forward(z, b, out):
        B, O = z.shape
        for r in range(B):
            for c in range(O):
                t = z[r, c] + b[c]
                z[r, c] = t
                out[r, c] = relu(t)

    @njit(nogil=True)
    def backward(dout, z, dz, sums):
        """dz <- dout * relu'(z); sums (float64) += its columns, rows in order."""
        B, O = z.shape
        for r in range(B):
            for c in range(O):
                d = dout[r, c] * relu_grad(z[r, c])
                dz[r, c] = d
                sums[c] += d

    return forward, backward


# GELU: a scalar libm exp in a numba loop does not vectorise, so exp runs as NumPy's SIMD ufunc
# over a block of rows and numba does the vectorisable arithmetic around it, one pass before
# and one after. The work array has z's dtype (float32 math for float32); blocks of about
# GELU_BLOCK elements keep it in L2. ``K`` is gelu_constants(z.dtype).
GELU_BLOCK = 1 << 15


@njit(cache=True, nogil=True)
def _gelu_exponent(z, b, r0, e, K, add):
    """e[i, c] <- -2 k (z + c z^3) of row r0 + i (exp of it is 1/s - 1); with ``add``, z += b first,
    in the same pass (forward's bias add: one read and write of z fewer)."""
    k, c, _, _, _, m2 = K
    for i in range(e.shape[0]):
        for j in range(e.shape[1]):
            v = z[r0 + i, j]
            if add:
                v = v + b[j]
                z[r0 + i, j] = v
            e[i, j] = m2 * k * (v + c * v * v * v)


@njit(cache=True, nogil=True)
def _gelu_out(z, e, r0, out, K):
    """out <- z s for the block's rows, e = exp(-2u)."""
    one = K[4]
    for i in range(e.shape[0]):
        for j in range(e.shape[1]):
            out[r0 + i, j] = z[r0 + i, j] * (one / (one + e[i, j]))


@njit(cache=True, nogil=True)
def _gelu_grad_out(dout, z, e, r0, dz, sums, K):
    """dz <- dout * gelu'(z) for the block's rows; sums (float64) += their columns, rows in order."""
    k, _, c3, _, one, m2 = K
    for i in range(e.shape[0]):
        for j in range(e.shape[1]):
            v = z[r0 + i, j]
            s = one / (one + e[i, j])
            d = dout[r0 + i, j] * (s - m2 * v * s * (one - s) * k * (one + c3 * v * v))
            dz[r0 + i, j] = d
            sums[j] += d


def _gelu_blocks(z, b=None):
    """(first row, exp(-2u) of the block's rows, constants) per block of rows; with ``b``, z += b
    as each block is read."""
    K = gelu_constants(z.dtype)
    rows = max(1, GELU_BLOCK // max(1, z.shape[1]))
    work = np.empty((min(rows, z.shape[0]), z.shape[1]), z.dtype)
    for r in range(0, z.shape[0], rows):
        e = work[:min(rows, z.shape[0] - r)]
        _gelu_exponent(z, z[0] if b is None else b, r, e, K, b is not None)
        with np.errstate(over="ignore"):  # v << 0: exp overflows to inf, s = 0, gelu = -0 (exact limit)
            np.exp(e, out=e)
        yield r, e, K


def _gelu_forward(z, b, out):
    """z += b; out <- gelu(z)."""
    for r, e, K in _gelu_blocks(z, b):
        _gelu_out(z, e, r, out, K)


def _gelu_backward(dout, z, dz, sums):
    for r, e, K in _gelu_blocks(z):
        _gelu_grad_out(dout, z, e, r, dz, sums, K)


@njit(cache=True, nogil=True)
def _column_sums(d, sums):
    """sums (float64) += the columns of d, rows in order (a loop LLVM vectorises across columns)."""
    for r in range(d.shape[0]):
        for c in range(d.shape[1]):
            sums[c] += d[r, c]


def bias_act_forward(z, b, out, act):
    """z (B, O) += b (O,); out (B, O) <- act(z). Returns out. Rows split over the CPU threads."""
    if act not in ("identity", "relu", "gelu"):
        raise ValueError(f"activation {act!r}: choose identity, relu or gelu")
    cpu_threads.for_rows(lambda lo, hi: _forward_rows(z[lo:hi], b, out[lo:hi], act), z.shape[0], z.size)
    return out


def _forward_rows(z, b, out, act):
    if act == "identity":  # the plain bias add vectorises; the generic loop's per-element branch does not
        np.add(z, b, out=z)
        if out is not z and not np.shares_memory(out, z):
            out[...] = z
    elif act == "gelu":
        _gelu_forward(z, b, out)
    else:
        _relu_cpu(z.dtype.name)[0](z, b, out)


def bias_act_backward(dout, z, dz, db, act, accumulate=False):
    """dz (B, O) <- dout * act'(z); db (O,) <- (db +) column sums of dz. Returns dz.

    The column sums are float64 partial sums over chunks of cpu_threads.CHUNK_ROWS rows, added in
    chunk order: the same bits at any thread count."""
    if act not in ("identity", "relu", "gelu"):
        raise ValueError(f"activation {act!r}: choose identity, relu or gelu")
    partials = np.zeros((cpu_threads.chunks_of(z.shape[0]), z.shape[1]))

    def chunk(c, lo, hi):
        if act == "identity":
            if dz is not dout:
                dz[lo:hi] = dout[lo:hi]
            _column_sums(dout[lo:hi], partials[c])
        elif act == "gelu":
            _gelu_backward(dout[lo:hi], z[lo:hi], dz[lo:hi], partials[c])
        else:
            _relu_cpu(z.dtype.name)[1](dout[lo:hi], z[lo:hi], dz[lo:hi], partials[c])
    cpu_threads.for_chunks(chunk, z.shape[0], z.size)
    sums = cpu_threads.add_partials(partials)
    db[...] = db + sums if accumulate else sums
    return dz

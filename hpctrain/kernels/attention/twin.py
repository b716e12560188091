"""Causal multi-head self-attention's CPU twin: the part between c_attn (QKV) and c_proj.

qkv (B, T, 3C) holds [q | k | v] along the last axis (GPT-2's c_attn layout); head h reads columns
h*hs:(h+1)*hs of q, k and v, hs = C / NH; out (B, T, C) holds head h at the same columns. Per (b, h):

forward:  S = q k^T / sqrt(hs) (T x T); position t attends to t' <= t;
          P = softmax of each row of S (max subtracted; masked entries exactly 0); y = P v.
backward: dV = P^T dY;  dP = dY V^T;  dS = P * (dP - rowsum(dP * P));
          dQ = dS K / sqrt(hs);  dK = dS^T Q / sqrt(hs).

``probs`` (B, NH, T, T) is the only T x T array kept between forward and backward; backward needs
one more of that size (dP, then dS in place: the caller's ``work``, or a transient one). The GEMMs
(two forward, four backward) run in NumPy's BLAS on strided views of qkv, out and dqkv (a head's
(T, hs) slice is a matrix with a leading dimension: nothing copied), and fill the masked half too;
the softmax is numba passes around NumPy's SIMD exp. The batch rows are split over the rank's CPU
threads (:mod:`~hpctrain.kernels.support.cpu_threads`), each row's heads alone: the same bits at any
thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..support import cpu_threads


# ---- CPU twin (numba + NumPy) -------------------------------------------------------
# Row reductions run four independent chains (lane u % 4, combined as
# (0 + 1) + (2 + 3)): one chain waits on each add's latency, four keep the
# adder busy; the order is fixed, so the bits are the same on every run.
@njit(cache=True, nogil=True)
def _row_max(x, n):
    m0 = m1 = m2 = m3 = x[0]
    u = 0
    while u + 4 <= n:
        m0, m1, m2, m3 = max(m0, x[u]), max(m1, x[u + 1]), max(m2, x[u + 2]), max(m3, x[u + 3])
        u += 4
    while u < n:
        m0 = max(m0, x[u])
        u += 1
    return max(max(m0, m1), max(m2, m3))


@njit(cache=True, nogil=True)
def _row_sum(x, n):
    # float64 sum of x[u] for u < n
    s0 = s1 = s2 = s3 = 0.0
    u = 0
    while u + 4 <= n:
        s0, s1, s2, s3 = s0 + x[u], s1 + x[u + 1], s2 + x[u + 2], s3 + x[u + 3]
        u += 4
    while u < n:
        s0 += x[u]
        u += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True)
def _row_dot(x, y, n):
    # float64 sum of x[u] * y[u] for u < n
    s0 = s1 = s2 = s3 = 0.0
    u = 0
    while u + 4 <= n:
        s0 += float(x[u]) * y[u]
        s1 += float(x[u + 1]) * y[u + 1]
        s2 += float(x[u + 2]) * y[u + 2]
        s3 += float(x[u + 3]) * y[u + 3]
        u += 4
    while u < n:
        s0 += float(x[u]) * y[u]
        u += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True)
def _shift_scores(s, scale):
    # s (B, NH, T, T) holds q k^T; row t becomes scale * (s - max over u <= t),
    # <= 0 so exp cannot overflow, and -inf above the diagonal so exp gives exactly 0
    B, NH, T, _ = s.shape
    for b in range(B):
        for h in range(NH):
            for t in range(T):
                row = s[b, h, t]
                m = _row_max(row, t + 1)
                for u in range(t + 1):
                    row[u] = scale * (row[u] - m)
                for u in range(t + 1, T):
                    row[u] = -np.inf


@njit(cache=True, nogil=True)
def _normalize_rows(p):
    # p holds the exponentials; each row is divided by its float64 sum over u <= t
    B, NH, T, _ = p.shape
    for b in range(B):
        for h in range(NH):
            for t in range(T):
                row = p[b, h, t]
                inv = 1.0 / _row_sum(row, t + 1)
                for u in range(t + 1):
                    row[u] = row[u] * inv


def _causal_softmax(probs, scale):
    """probs (B, NH, T, T) holding q k^T becomes P, in place.

    exp runs in NumPy's SIMD exp over the whole array (masked entries are
    exp(-inf) = 0): a scalar exp per element in numba took 2.4x as long as the
    three passes together (B=16, T=128, NH=4, float32).
    """
    _shift_scores(probs, probs.dtype.type(scale))  # float32 arithmetic for float32: ~10% faster pass
    np.exp(probs, out=probs)
    _normalize_rows(probs)


@njit(cache=True, nogil=True)
def _causal_softmax_backward(probs, dp, scale):
    # dp (B, NH, T, T) holds dY V^T; in place it becomes dS * scale
    B, NH, T, _ = probs.shape
    for b in range(B):
        for h in range(NH):
            for t in range(T):
                p, d = probs[b, h, t], dp[b, h, t]
                s = _row_dot(d, p, t + 1)
                for u in range(t + 1):
                    d[u] = scale * p[u] * (d[u] - s)
                for u in range(t + 1, T):
                    d[u] = 0.0


def _qkv_heads(a, n_head, part):
    """(B, NH, T, hs) view of q (part 0), k (1) or v (2) inside a (B, T, 3C) array."""
    B, T, C3 = a.shape
    return a.reshape(B, T, 3, n_head, C3 // (3 * n_head))[:, :, part].transpose(0, 2, 1, 3)


def _heads(a, n_head):
    """(B, NH, T, hs) view of a (B, T, C) array whose columns are the heads side by side."""
    B, T, C = a.shape
    return a.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def _check(op, qkv, n_head, probs, written):
    """Shapes and layout the views below rely on; ``written`` lists (name, array, expected shape)."""
    B, T, C3 = qkv.shape
    if C3 % 3 or (C3 // 3) % n_head:
        raise ValueError(f"{op}: qkv's last axis {C3} must be 3*C with C divisible by n_head={n_head}")
    if probs.shape != (B, n_head, T, T):
        raise ValueError(f"{op}: probs has shape {probs.shape}, expected {(B, n_head, T, T)}")
    for name, a, shape in written:
        if a.shape != shape:
            raise ValueError(f"{op}: {name} has shape {a.shape}, expected {shape}")
        # reshape of a non-contiguous array would copy, and the results would be lost
        if not a.flags.c_contiguous:
            raise ValueError(f"{op}: {name} must be C-contiguous")
        if a.dtype != qkv.dtype:
            raise ValueError(f"{op}: {name} is {a.dtype} but qkv is {qkv.dtype}; use one float dtype")


def attention_forward(qkv, n_head, out, probs):
    """out (B, T, C) <- causal attention of qkv (B, T, 3C); probs (B, NH, T, T) <- P. Returns out.

    probs is what :func:`attention_backward` needs (zeros above the diagonal,
    rows sum to 1): B*NH*T*T values per layer (4 MiB at B=16, NH=4, T=128 in
    float32), and nothing else T x T is kept. One float dtype throughout. The batch
    rows are split over the rank's CPU threads (:mod:`.cpu_threads`; each row's
    heads alone, so the same bits at any thread count).
    """
    B, T, C3 = qkv.shape
    _check("attention_forward", qkv, n_head, probs,
           [("out", out, (B, T, C3 // 3)), ("probs", probs, probs.shape)])
    cpu_threads.for_rows(lambda lo, hi: _forward_rows(qkv[lo:hi], n_head, out[lo:hi], probs[lo:hi]), B,
                         probs.size, ns_per_element=2.0)
    return out


def _forward_rows(qkv, n_head, out, probs):
    """:func:`attention_forward` of some batch rows, checked."""
    q, k, v = (_qkv_heads(qkv, n_head, i) for i in range(3))
    hs = q.shape[-1]
    np.matmul(q, k.swapaxes(-1, -2), out=probs)  # raw scores; the softmax scales them
    _causal_softmax(probs, 1.0 / math.sqrt(hs))
    np.matmul(probs, v, out=_heads(out, n_head))


def attention_backward(dout, qkv, out, probs, n_head, dqkv, work=None):
    """dqkv (B, T, 3C) <- gradients of q, k, v (overwritten, qkv's layout). Returns dqkv.

    dout (B, T, C) is the gradient of the forward's out; qkv and probs are the
    forward's input and saved P. ``out`` (the forward's output) is unused here:
    it is in the signature because the CUDA kernels, which keep no P, need it.
    ``work``, shaped like probs, holds dP and dS (a caller that keeps one per
    layer saves a T x T allocation per call); None: allocated.
    """
    B, T, C3 = qkv.shape
    work = np.empty_like(probs) if work is None else work
    _check("attention_backward", qkv, n_head, probs,
           [("dqkv", dqkv, qkv.shape), ("dout", dout, (B, T, C3 // 3)), ("work", work, probs.shape)])
    cpu_threads.for_rows(lambda lo, hi: _backward_rows(dout[lo:hi], qkv[lo:hi], probs[lo:hi], n_head, dqkv[lo:hi],
                                                       work[lo:hi]), B, probs.size, ns_per_element=3.0)
    return dqkv


def _backward_rows(dout, qkv, probs, n_head, dqkv, work):
    """:func:`attention_backward` of some batch rows, checked."""
    q, k, v = (_qkv_heads(qkv, n_head, i) for i in range(3))
    dq, dk, dv = (_qkv_heads(dqkv, n_head, i) for i in range(3))
    dy = _heads(dout, n_head)
    hs = q.shape[-1]
    np.matmul(probs.swapaxes(-1, -2), dy, out=dv)        # dV = P^T dY
    ds = np.matmul(dy, v.swapaxes(-1, -2), out=work)     # dP = dY V^T, the one T x T temporary
    _causal_softmax_backward(probs, ds, 1.0 / math.sqrt(hs))  # dS / sqrt(hs), in place
    np.matmul(ds, k, out=dq)                              # dQ = dS K / sqrt(hs)
    np.matmul(ds.swapaxes(-1, -2), q, out=dk)             # dK = dS^T Q / sqrt(hs)


def attention_state_shapes(B, n_head, T):
    """(shape of the state forward saves for backward, shape of backward's work array):
    P and dP/dS, both (B, NH, T, T), for this twin. The CUDA paths (flash.py, gemm.py)
    keep (B, NH, T) arrays instead; layers ask the device's table, so either fits."""
    return (B, n_head, T, T), (B, n_head, T, T)

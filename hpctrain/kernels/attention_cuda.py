"""Causal multi-head attention as CUDA kernels, flash-attention style (the CPU twin is :mod:`.attention`).

Contract (the twin's layout): qkv (B, T, 3C) holds [q | k | v] along the last
axis; head h reads columns h*hs:(h+1)*hs of q, k and v (hs = C / NH); out
(B, T, C) holds head h at columns h*hs:(h+1)*hs. Position t attends to t' <= t,
scores are scaled by 1/sqrt(hs). One float dtype (float32 or float64) for every
array, and the math runs in it. Called by the CUDA device's op table on the
device's stream; all arrays are device arrays.

  lse  (B, NH, T): per query row, max + log(sum exp) of the scaled, masked
       scores - the only softmax state kept between forward and backward
       (the twin keeps the whole T x T P instead);
  work (B, NH, T): backward scratch, D = rowsum(dout * out) per head row.

Forward (block per (b, h, query tile), TILE x TILE threads): the Q tile stays
in shared memory while K/V tiles stream through it; each row keeps a running
max m, sum l and output accumulator, rescaled by exp(m_old - m_new) when the
max grows (the online softmax), so no T x T matrix ever reaches global memory.
Key tiles entirely after the tile's last query row are never visited.

Backward recomputes P = exp(scale q k^T - lse) per tile (masked = 0):
  1. D = rowsum(dO * O) (= rowsum(dP * P), the softmax's row term), into work;
  2. block per (b, h, key tile): loop over query tiles, dV += P^T dO,
     dS = P * (dO V^T - D), dK += scale dS^T Q; written once;
  3. block per (b, h, query tile): loop over key tiles, dQ += scale dS K.
Every output element is owned by one thread of one block and summed in a fixed
order (no atomics), so the results are bitwise the same on every run.

Shared arrays need compile-time shapes, so kernels are built per (dtype, TILE,
HS_MAX) (HS_MAX: head sizes up to 32, 64 or 128; head dims past hs are zeros in
shared memory, so dot products run to the constant HS_MAX); the launcher picks
the largest TILE whose shared memory fits SMEM_LIMIT (see :func:`choose_tile`).
Measured on an H100 (B=4, NH=12, T=1024, hs=64, float32): forward 3.0 ms,
backward 5.5-6.2 ms, ~2.5 TFLOP/s: one score per thread from shared memory, far
below cuBLAS-class tiling, but no T x T traffic.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, float64

from .cuda_support import blocks_for, simulated

HS_SIZES = (32, 64, 128)   # compiled head-size capacities; hs above the last is refused
TILES = (32, 16, 8, 4)     # query/key rows per tile, largest first; blocks are TILE x TILE threads
SMEM_LIMIT = 44 * 1024     # static shared memory per block is capped at 48 KiB; keep a margin
MAX_GRID_Y = 65535         # CUDA's gridDim.y limit (query or key tiles); (b, h) goes on grid x


def attention_state_shapes(B, NH, T):
    """(shape of the saved lse, shape of backward's work): both (B, NH, T)."""
    return (B, NH, T), (B, NH, T)


def _smem_bytes(kind, tile, hs_max, itemsize):
    """Static shared memory of one block (the arrays declared in the kernels below)."""
    rows, square = tile * (hs_max + 1), tile * (tile + 1)
    n = {"forward": 3 * rows + square,                   # Q, K, V, scores
         "backward_dkv": 4 * rows + 2 * square + 2 * tile,  # K, V, Q, dO, P, dS, lse, D
         "backward_dq": 4 * rows + square + 2 * tile}[kind]  # Q, dO, K, V, dS, lse, D
    return n * itemsize


def hs_capacity(hs):
    """The smallest compiled HS_MAX that holds head size hs."""
    for m in HS_SIZES:
        if hs <= m:
            return m
    raise ValueError(f"attention on CUDA: head size {hs} exceeds the kernels' limit of {HS_SIZES[-1]}; "
                     f"use more heads (hs = C / n_head) or the CPU device")


def choose_tile(kind, dtype, hs, T):
    """The largest tile whose shared memory fits SMEM_LIMIT for this dtype and head size,
    and no larger than T rounded up to a power of two (a bigger tile would only idle threads)."""
    hs_max, itemsize = hs_capacity(hs), np.dtype(dtype).itemsize
    cap = max(TILES[-1], 1 << max(0, T - 1).bit_length())
    return next(t for t in TILES if t <= cap and _smem_bytes(kind, t, hs_max, itemsize) <= SMEM_LIMIT)


# ---- CUDA kernels ------------------------------------------------------------------
@lru_cache(maxsize=None)
def _kernels(dtype_name: str, TILE: int, HS_MAX: int):
    """(forward, backward_dkv, backward_dq) for one dtype, tile and head-size capacity."""
    nb = {"float32": float32, "float64": float64}[dtype_name]
    # Constants in the compute dtype: a Python float literal (0.0, -math.inf) is a
    # float64 and would promote a float32 kernel's arithmetic to float64 (slow on
    # GPUs and not what the float32 twin computes). math.exp / math.log of a
    # float32 value stay float32 (expf / logf).
    ZERO, NEG_INF = np.dtype(dtype_name).type(0), np.dtype(dtype_name).type(-np.inf)
    PAD = HS_MAX + 1     # row stride of (TILE, hs) tiles: +1 puts a warp's rows q[r, d] in distinct banks
    SP = TILE + 1        # row stride of (TILE, TILE) tiles, for the same reason
    NACC = HS_MAX // TILE  # head dims per thread: d = tx + k * TILE; constant, so they stay in registers
    NT = TILE * TILE
    # A TILE 32 block has 1024 threads, which leaves 64 registers a thread; unbounded, ptxas gives
    # these kernels 76-95 and the launch fails. The bound makes it fit (no spills at sm_90).
    # The simulator's jit takes no launch_bounds.
    kernel = cuda.jit if simulated() else cuda.jit(launch_bounds=NT)

    @cuda.jit(device=True)
    def load_rows(src, b, t0, col0, T, hs, dst):
        # dst[r, d] <- src[b, t0 + r, col0 + d], consecutive threads on consecutive d (coalesced).
        # Zero past T (P is 0 there, but 0 * uninitialised shared memory could be NaN) and for
        # hs <= d < HS_MAX, so the dot products run to the constant HS_MAX: fully unrolled, with
        # constant shared offsets and power-of-two index math (adding 0 * 0 changes no bit).
        for l in range(NACC):
            e = cuda.threadIdx.y * TILE + cuda.threadIdx.x + l * NT
            r, d = e // HS_MAX, e % HS_MAX
            dst[r, d] = src[b, t0 + r, col0 + d] if t0 + r < T and d < hs else ZERO

    @cuda.jit(device=True)
    def load_lse_d(lse, dsum, b, h, t0, T, Ls, Ds):
        e = cuda.threadIdx.y * TILE + cuda.threadIdx.x
        if e < TILE:
            Ls[e] = lse[b, h, t0 + e] if t0 + e < T else ZERO
            Ds[e] = dsum[b, h, t0 + e] if t0 + e < T else ZERO

    @cuda.jit(device=True)
    def p_ds(Qs, dOs, r, Ks, Vs, c, scale, L, D):
        # P and dS of query row r against key row c, P recomputed from the row's lse L
        s, dp = ZERO, ZERO
        for d in range(HS_MAX):
            s += Qs[r, d] * Ks[c, d]
            dp += dOs[r, d] * Vs[c, d]
        p = math.exp(s * scale - L)
        return p, p * (dp - D)

    @kernel
    def forward(qkv, n_head, scale, out, lse):
        T, C = qkv.shape[1], qkv.shape[2] // 3
        hs = C // n_head
        b, h = cuda.blockIdx.x // n_head, cuda.blockIdx.x % n_head
        ty, tx = cuda.threadIdx.y, cuda.threadIdx.x  # thread: query row ty x (key tx, then dims tx + k TILE)
        i0 = cuda.blockIdx.y * TILE
        i = i0 + ty
        Qs = cuda.shared.array((TILE, PAD), nb)
        Ks = cuda.shared.array((TILE, PAD), nb)
        Vs = cuda.shared.array((TILE, PAD), nb)
        Ss = cuda.shared.array((TILE, SP), nb)
        acc = cuda.local.array(NACC, nb)
        for k in range(NACC):
            acc[k] = ZERO
        m, l = NEG_INF, ZERO
        load_rows(qkv, b, i0, h * hs, T, hs, Qs)
        for j0 in range(0, min(i0 + TILE, T), TILE):  # key tiles holding a key <= the tile's last query
            load_rows(qkv, b, j0, C + h * hs, T, hs, Ks)
            load_rows(qkv, b, j0, 2 * C + h * hs, T, hs, Vs)
            cuda.syncthreads()
            j = j0 + tx
            s = NEG_INF  # masked: exp gives exactly 0
            if j <= i and j < T:
                s = ZERO
                for d in range(HS_MAX):
                    s += Qs[ty, d] * Ks[tx, d]
                s *= scale
            Ss[ty, tx] = s
            cuda.syncthreads()
            # Key 0 is in the first tile and visible to every row, so m_new is finite from then on.
            m_new = m
            for c in range(TILE):
                m_new = max(m_new, Ss[ty, c])
            cuda.syncthreads()  # the whole row has read its scores before they turn into probabilities
            Ss[ty, tx] = math.exp(s - m_new)
            cuda.syncthreads()
            alpha = math.exp(m - m_new)  # rescales what was summed under the old max (0 on the first tile)
            l *= alpha
            for k in range(NACC):
                acc[k] *= alpha
            for c in range(TILE):  # each P read once; columns d >= hs are zeros
                p = Ss[ty, c]
                l += p
                for k in range(NACC):
                    acc[k] += p * Vs[c, tx + k * TILE]
            m = m_new
            cuda.syncthreads()  # K, V and P are consumed before the next tile overwrites them
        if i < T:
            for k in range(NACC):
                d = tx + k * TILE
                if d < hs:
                    out[b, i, h * hs + d] = acc[k] / l
            if tx == 0:
                lse[b, h, i] = m + math.log(l)

    @kernel
    def backward_dkv(dout, qkv, lse, dsum, n_head, scale, dqkv):
        T, C = qkv.shape[1], qkv.shape[2] // 3
        hs = C // n_head
        b, h = cuda.blockIdx.x // n_head, cuda.blockIdx.x % n_head
        ty, tx = cuda.threadIdx.y, cuda.threadIdx.x  # thread: key row ty x (query tx, then dims tx + k TILE)
        j0 = cuda.blockIdx.y * TILE
        j = j0 + ty
        Ks = cuda.shared.array((TILE, PAD), nb)
        Vs = cuda.shared.array((TILE, PAD), nb)
        Qs = cuda.shared.array((TILE, PAD), nb)
        dOs = cuda.shared.array((TILE, PAD), nb)
        Ps = cuda.shared.array((TILE, SP), nb)   # [key, query]: P^T
        dSs = cuda.shared.array((TILE, SP), nb)  # [key, query]: dS^T
        Ls = cuda.shared.array(TILE, nb)  # one shared array a line: the simulator keys them by line
        Ds = cuda.shared.array(TILE, nb)
        dk = cuda.local.array(NACC, nb)
        dv = cuda.local.array(NACC, nb)
        for k in range(NACC):
            dk[k], dv[k] = ZERO, ZERO
        load_rows(qkv, b, j0, C + h * hs, T, hs, Ks)
        load_rows(qkv, b, j0, 2 * C + h * hs, T, hs, Vs)
        for i0 in range(j0, T, TILE):  # query tiles before j0 see none of these keys
            load_rows(qkv, b, i0, h * hs, T, hs, Qs)
            load_rows(dout, b, i0, h * hs, T, hs, dOs)
            load_lse_d(lse, dsum, b, h, i0, T, Ls, Ds)
            cuda.syncthreads()
            i = i0 + tx
            p, ds = ZERO, ZERO
            if j <= i and i < T:
                p, ds = p_ds(Qs, dOs, tx, Ks, Vs, ty, scale, Ls[tx], Ds[tx])
            Ps[ty, tx] = p
            dSs[ty, tx] = ds
            cuda.syncthreads()
            for r in range(TILE):
                p, ds = Ps[ty, r], dSs[ty, r]
                for k in range(NACC):
                    dv[k] += p * dOs[r, tx + k * TILE]
                    dk[k] += ds * Qs[r, tx + k * TILE]
            cuda.syncthreads()  # Q, dO, P, dS are consumed before the next query tile overwrites them
        if j < T:
            for k in range(NACC):
                d = tx + k * TILE
                if d < hs:
                    dqkv[b, j, C + h * hs + d] = scale * dk[k]
                    dqkv[b, j, 2 * C + h * hs + d] = dv[k]

    @kernel
    def backward_dq(dout, qkv, lse, dsum, n_head, scale, dqkv):
        T, C = qkv.shape[1], qkv.shape[2] // 3
        hs = C // n_head
        b, h = cuda.blockIdx.x // n_head, cuda.blockIdx.x % n_head
        ty, tx = cuda.threadIdx.y, cuda.threadIdx.x  # thread: query row ty x (key tx, then dims tx + k TILE)
        i0 = cuda.blockIdx.y * TILE
        i = i0 + ty
        Qs = cuda.shared.array((TILE, PAD), nb)
        dOs = cuda.shared.array((TILE, PAD), nb)
        Ks = cuda.shared.array((TILE, PAD), nb)
        Vs = cuda.shared.array((TILE, PAD), nb)
        dSs = cuda.shared.array((TILE, SP), nb)
        Ls = cuda.shared.array(TILE, nb)  # one shared array a line: the simulator keys them by line
        Ds = cuda.shared.array(TILE, nb)
        dq = cuda.local.array(NACC, nb)
        for k in range(NACC):
            dq[k] = ZERO
        load_rows(qkv, b, i0, h * hs, T, hs, Qs)
        load_rows(dout, b, i0, h * hs, T, hs, dOs)
        load_lse_d(lse, dsum, b, h, i0, T, Ls, Ds)
        for j0 in range(0, min(i0 + TILE, T), TILE):  # as forward: fully masked key tiles skipped
            load_rows(qkv, b, j0, C + h * hs, T, hs, Ks)
            load_rows(qkv, b, j0, 2 * C + h * hs, T, hs, Vs)
            cuda.syncthreads()
            j = j0 + tx
            ds = ZERO
            if j <= i and i < T:
                ds = p_ds(Qs, dOs, ty, Ks, Vs, tx, scale, Ls[ty], Ds[ty])[1]
            dSs[ty, tx] = ds
            cuda.syncthreads()
            for c in range(TILE):
                ds = dSs[ty, c]
                for k in range(NACC):
                    dq[k] += ds * Ks[c, tx + k * TILE]
            cuda.syncthreads()
        if i < T:
            for k in range(NACC):
                d = tx + k * TILE
                if d < hs:
                    dqkv[b, i, h * hs + d] = scale * dq[k]

    return forward, backward_dkv, backward_dq


@lru_cache(maxsize=None)
def _dsum_kernel(dtype_name: str):
    """work[b, h, i] <- dout[b, i, head h] . out[b, i, head h], summed in the compute dtype."""
    ZERO = np.dtype(dtype_name).type(0)  # float32 sums stay float32 (see _kernels)

    @cuda.jit
    def dsum(dout, out, n_head, work):
        B, T, C = out.shape
        hs = C // n_head
        e = cuda.grid(1)
        while e < B * T * n_head:  # h fastest: neighbouring threads read neighbouring columns
            h, bt = e % n_head, e // n_head
            b, i = bt // T, bt % T
            s = ZERO
            for d in range(hs):
                s += dout[b, i, h * hs + d] * out[b, i, h * hs + d]
            work[b, h, i] = s
            e += cuda.gridsize(1)

    return dsum


# ---- launchers ---------------------------------------------------------------------
def _check(op, qkv, n_head, arrays):
    """Shapes and dtypes the kernels rely on; ``arrays`` lists (name, array, expected shape). Returns hs."""
    B, T, C3 = qkv.shape
    if n_head < 1 or C3 % 3 or C3 == 0 or (C3 // 3) % n_head:
        raise ValueError(f"{op}: qkv's last axis {C3} must be 3*C with C a positive multiple of n_head={n_head}")
    if np.dtype(qkv.dtype) not in (np.float32, np.float64):
        raise ValueError(f"{op}: qkv is {qkv.dtype}; the kernels take float32 or float64")
    for name, a, shape in arrays:
        if tuple(a.shape) != shape:
            raise ValueError(f"{op}: {name} has shape {tuple(a.shape)}, expected {shape}")
        if a.dtype != qkv.dtype:
            raise ValueError(f"{op}: {name} is {a.dtype} but qkv is {qkv.dtype}; use one float dtype")
    hs = C3 // 3 // n_head
    hs_capacity(hs)  # raises above the limit
    return hs


def _configured(op, kind, dtype, B, n_head, hs, T, tile):
    """kind's kernel configured as kernel[grid, block]: ``tile`` if forced (tests; it must fit too),
    else :func:`choose_tile`'s; grid x = (b, h) pairs, y = tiles, block = TILE x TILE threads."""
    if tile is None:
        tile = choose_tile(kind, dtype, hs, T)
    elif tile not in TILES or _smem_bytes(kind, tile, hs_capacity(hs), np.dtype(dtype).itemsize) > SMEM_LIMIT:
        raise ValueError(f"{op}: tile {tile} is not one of {TILES} or does not fit {SMEM_LIMIT} B of "
                         f"shared memory at head size {hs}")
    if -(-T // tile) > MAX_GRID_Y:
        raise ValueError(f"{op}: {-(-T // tile)} tiles of {tile} exceed gridDim.y {MAX_GRID_Y}; shorten T")
    kernels = _kernels(np.dtype(dtype).name, tile, hs_capacity(hs))
    return kernels[("forward", "backward_dkv", "backward_dq").index(kind)], (B * n_head, -(-T // tile)), (tile, tile)


def attention_forward_cuda(qkv, n_head, out, lse, *, stream=0, tile=None):
    """out (B, T, C) <- causal attention of qkv (B, T, 3C); lse (B, NH, T) <- row log-sum-exp. Returns out.

    ``tile`` forces the tile (4, 8, 16 or 32; tests use it); by default :func:`choose_tile` picks.
    """
    B, T, C3 = qkv.shape
    hs = _check("attention_forward_cuda", qkv, n_head,
                [("out", out, (B, T, C3 // 3)), ("lse", lse, (B, n_head, T))])
    if B == 0 or T == 0:
        return out
    forward, grid, block = _configured("attention_forward_cuda", "forward", qkv.dtype, B, n_head, hs, T, tile)
    forward[grid, block, stream](qkv, int(n_head), qkv.dtype.type(1.0 / math.sqrt(hs)), out, lse)
    return out


def attention_backward_cuda(dout, qkv, out, lse, n_head, dqkv, work, *, stream=0, tile=None):
    """dqkv (B, T, 3C) <- gradients of q, k, v (overwritten, qkv's layout). Returns dqkv.

    dout (B, T, C) is the gradient of the forward's out; qkv, out and lse are the
    forward's input and results; work (B, NH, T) is scratch (it ends holding D).
    """
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = _check("attention_backward_cuda", qkv, n_head,
                [("dout", dout, (B, T, C)), ("out", out, (B, T, C)), ("lse", lse, (B, n_head, T)),
                 ("dqkv", dqkv, qkv.shape), ("work", work, (B, n_head, T))])
    if B == 0 or T == 0:
        return dqkv
    scale = qkv.dtype.type(1.0 / math.sqrt(hs))  # a float32 scalar for float32 kernels (see _kernels)
    _dsum_kernel(np.dtype(qkv.dtype).name)[blocks_for(B * T * n_head), 256, stream](dout, out, int(n_head), work)
    for kind in ("backward_dkv", "backward_dq"):  # D is complete before either reads it (one stream)
        kernel, grid, block = _configured("attention_backward_cuda", kind, qkv.dtype, B, n_head, hs, T, tile)
        kernel[grid, block, stream](dout, qkv, lse, work, int(n_head), scale, dqkv)
    return dqkv

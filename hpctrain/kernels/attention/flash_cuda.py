"""The flash kernels of causal attention (numba CUDA); the contract, the tile choice and the
launchers are in :mod:`.flash`, which says what each kernel computes.

Shared arrays need compile-time shapes, so kernels are built (and cached) per (dtype, TILE,
HS_MAX): TILE query/key rows per tile, blocks of TILE x TILE threads; HS_MAX the compiled
head-size capacity (head dims past hs are zeros in shared memory, so dot products run to the
constant HS_MAX). :func:`.flash._smem_bytes` counts the shared arrays declared here.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, float64

from ..support.cuda_support import simulated


@lru_cache(maxsize=None)
def attention_kernels(dtype_name: str, TILE: int, HS_MAX: int):
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
def dsum_kernel(dtype_name: str):
    """work[b, h, i] <- dout[b, i, head h] . out[b, i, head h], summed in the compute dtype."""
    ZERO = np.dtype(dtype_name).type(0)  # float32 sums stay float32 (see attention_kernels)

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

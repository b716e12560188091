"""Causal multi-head attention as CUDA kernels, flash-attention style (the CPU twin is :mod:`.twin`).

Contract (the twin's layout): qkv (B, T, 3C) holds [q | k | v] along the last axis; head h reads
columns h*hs:(h+1)*hs of each (hs = C / NH); out (B, T, C) holds head h at the same columns.
Position t attends to t' <= t, scores scaled by 1/sqrt(hs). One float dtype (float32 or float64) for
every array, and the math runs in it. Called through the CUDA device's op table, on its stream.

  lse  (B, NH, T): per query row, max + log(sum exp) of the scaled, masked scores: the only softmax
       state kept between forward and backward (the twin keeps the whole T x T P instead);
  work (B, NH, T): backward's scratch, D = rowsum(dout * out) per head row.

Forward, a block per (b, h, query tile) of TILE x TILE threads: the Q tile stays in shared memory
while K/V tiles stream through it, an online softmax (running max and sum, the accumulator rescaled)
keeps every T x T matrix out of global memory, and key tiles wholly after the tile's last query are
skipped. Backward recomputes P = exp(scale q k^T - lse) per tile: 1. D into work; 2. a block per
(b, h, key tile) accumulates dK and dV over the query tiles; 3. a block per (b, h, query tile)
accumulates dQ over the key tiles. Each output element is written by one thread in a fixed order (no
atomics): the same bits every run. :func:`choose_tile` takes the largest TILE whose shared memory
fits :data:`SMEM_LIMIT` at the head size's capacity (HS_MAX). Timings: docs/benchmarks.md.
"""

from __future__ import annotations

import math

import numpy as np

from ..support.cuda_support import blocks_for, configured
from ..support.lazy_import import lazy_import

kernels = lazy_import(f"{__package__}.flash_cuda")  # the CUDA kernels launched here (imported at the first launch)

HS_SIZES = (32, 64, 128)   # compiled head-size capacities; hs above the last is refused
TILES = (32, 16, 8, 4)     # query/key rows per tile, largest first; blocks are TILE x TILE threads
SMEM_LIMIT = 44 * 1024     # static shared memory per block is capped at 48 KiB; keep a margin
MAX_GRID_Y = 65535         # CUDA's gridDim.y limit (query or key tiles); (b, h) goes on grid x


def attention_state_shapes_cuda(B, NH, T):
    """(shape of the saved lse, shape of backward's work): both (B, NH, T)."""
    return (B, NH, T), (B, NH, T)


def _smem_bytes(kind, tile, hs_max, itemsize):
    """Static shared memory of one block (the arrays declared in flash_cuda.py's kernels)."""
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


# ---- launchers ---------------------------------------------------------------------
def check_operands(op, qkv, n_head, arrays, any_head_size=False):
    """Shapes and dtypes the kernels rely on; ``arrays`` lists (name, array, expected shape). Returns hs.
    ``any_head_size``: no compiled head-size limit (the GEMM path, :mod:`.gemm`)."""
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
    if not any_head_size:
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
    built = kernels.attention_kernels(np.dtype(dtype).name, tile, hs_capacity(hs))
    return built[("forward", "backward_dkv", "backward_dq").index(kind)], (B * n_head, -(-T // tile)), (tile, tile)


def attention_forward_cuda(qkv, n_head, out, lse, *, stream=0, tile=None):
    """out (B, T, C) <- causal attention of qkv (B, T, 3C); lse (B, NH, T) <- row log-sum-exp. Returns out.

    ``tile`` forces the tile (4, 8, 16 or 32; tests use it); by default :func:`choose_tile` picks.
    """
    B, T, C3 = qkv.shape
    hs = check_operands("attention_forward_cuda", qkv, n_head,
                [("out", out, (B, T, C3 // 3)), ("lse", lse, (B, n_head, T))])
    if B == 0 or T == 0:
        return out
    forward, grid, block = _configured("attention_forward_cuda", "forward", qkv.dtype, B, n_head, hs, T, tile)
    configured(forward, grid, block, stream)(qkv, int(n_head), qkv.dtype.type(1.0 / math.sqrt(hs)), out, lse)
    return out


def attention_backward_cuda(dout, qkv, out, lse, n_head, dqkv, work, *, stream=0, tile=None):
    """dqkv (B, T, 3C) <- gradients of q, k, v (overwritten, qkv's layout). Returns dqkv.

    dout (B, T, C) is the gradient of the forward's out; qkv, out and lse are the
    forward's input and results; work (B, NH, T) is scratch (it ends holding D).
    """
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = check_operands("attention_backward_cuda", qkv, n_head,
                [("dout", dout, (B, T, C)), ("out", out, (B, T, C)), ("lse", lse, (B, n_head, T)),
                 ("dqkv", dqkv, qkv.shape), ("work", work, (B, n_head, T))])
    if B == 0 or T == 0:
        return dqkv
    scale = qkv.dtype.type(1.0 / math.sqrt(hs))  # a float32 scalar for float32 kernels (see attention_kernels)
    dsum = configured(kernels.dsum_kernel(np.dtype(qkv.dtype).name), blocks_for(B * T * n_head), 256, stream)
    dsum(dout, out, int(n_head), work)
    for kind in ("backward_dkv", "backward_dq"):  # D is complete before either reads it (one stream)
        kernel, grid, block = _configured("attention_backward_cuda", kind, qkv.dtype, B, n_head, hs, T, tile)
        configured(kernel, grid, block, stream)(dout, qkv, lse, work, int(n_head), scale, dqkv)
    return dqkv

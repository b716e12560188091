"""The CUDA kernels of embedding.py (forward, dwpe's batch sums, dwte's bucketed scatter-add in
(b, t) order: the contract and why in embedding.py's docstring). Launched by embedding.py.
"""

from __future__ import annotations

import math

from numba import cuda, float64, int32

from .support.cuda_support import THREADS


TOKEN_THREADS = 128  # channels per dwte block (one token id)


@cuda.jit
def embedding_forward_kernel(tokens, wte, wpe, out):
    B, T, C = out.shape
    V = wte.shape[0]
    i = cuda.grid(1)
    while i < B * T * C:
        n, c = divmod(i, C)
        b, t = divmod(n, T)
        tok = tokens[b, t]
        if tok >= 0 and tok < V:
            out[b, t, c] = wte[tok, c] + wpe[t, c]
        else:  # never read outside wte: a NaN row makes the loss NaN instead
            out[b, t, c] = math.nan
        i += cuda.gridsize(1)


@cuda.jit
def dwpe_kernel(dout, dwpe, accumulate):
    # one thread per (t, c) of dwpe: the batch sum in b order, in float64, as the twin
    B, T, C = dout.shape
    i = cuda.grid(1)
    while i < dwpe.shape[0] * C:
        t, c = divmod(i, C)
        if t < T:
            s = float64(0.0)
            for b in range(B):
                s += dout[b, t, c]
            dwpe[t, c] = dwpe[t, c] + s if accumulate else s
        elif not accumulate:
            dwpe[t, c] = 0.0
        i += cuda.gridsize(1)


@cuda.jit
def zero_counts_kernel(counts):
    i = cuda.grid(1)
    while i < counts.size:
        counts[i] = 0
        i += cuda.gridsize(1)


@cuda.jit
def count_tokens_kernel(tokens, counts):
    # bucket sizes: integer atomics, so the order they land in does not matter
    B, T = tokens.shape
    n = cuda.grid(1)
    while n < B * T:
        tok = tokens[n // T, n % T]
        if tok >= 0 and tok < counts.size:
            cuda.atomic.add(counts, tok, 1)
        n += cuda.gridsize(1)


@cuda.jit
def bucket_offsets_kernel(counts, offsets):
    # one block: exclusive scan of counts into offsets (V + 1). Each thread sums
    # a segment of ids, thread 0 scans the THREADS totals (a few microseconds),
    # each thread writes its segment's offsets and zeroes the counts: cursors next.
    t = cuda.threadIdx.x
    sh = cuda.shared.array(THREADS, int32)
    V = counts.size
    seg = -(-V // THREADS)
    lo = min(V, t * seg)
    hi = min(V, lo + seg)
    total = 0
    for i in range(lo, hi):
        total += counts[i]
    sh[t] = total
    cuda.syncthreads()
    if t == 0:
        run = 0
        for k in range(THREADS):
            size = sh[k]
            sh[k] = run
            run += size
        offsets[V] = run
    cuda.syncthreads()
    run = sh[t]
    for i in range(lo, hi):
        offsets[i] = run
        run += counts[i]
        counts[i] = 0


@cuda.jit
def place_positions_kernel(tokens, offsets, cursors, placed):
    # each position n = b T + t into its token's bucket, in whatever order the atomics give
    B, T = tokens.shape
    n = cuda.grid(1)
    while n < B * T:
        tok = tokens[n // T, n % T]
        if tok >= 0 and tok < cursors.size:
            placed[offsets[tok] + cuda.atomic.add(cursors, tok, 1)] = n
        n += cuda.gridsize(1)


@cuda.jit
def sort_buckets_kernel(tokens, offsets, placed, order):
    # sort each bucket by rank: its positions are distinct, so each one's place is
    # how many in the bucket are smaller: O(m) per position, O(m^2) per bucket of m.
    # Buckets of natural text are a few hundred (byte-level: the space, ~15 % of B T);
    # a batch that is mostly one token (padding) makes this quadratic in B T.
    B, T = tokens.shape
    V = offsets.size - 1
    k = cuda.grid(1)
    while k < offsets[V]:  # the placed positions: dropped ids left the slots past them unwritten
        p = placed[k]
        tok = tokens[p // T, p % T]
        start, end = offsets[tok], offsets[tok + 1]
        rank = 0
        for j in range(start, end):
            if placed[j] < p:
                rank += 1
        order[start + rank] = p
        k += cuda.gridsize(1)


@cuda.jit
def dwte_kernel(dout, offsets, order, dwte):
    # block (token id v, chunk of channels), one thread per channel c, dout as
    # (B T, C): dwte[v, c] += its bucket's rows one at a time in ascending
    # position, i.e. (b, t), order - the twin's additions, in dwte's dtype.
    # Empty buckets exit at once; blocks step over ids (grid-stride).
    c = cuda.blockIdx.y * TOKEN_THREADS + cuda.threadIdx.x
    v = cuda.blockIdx.x
    while v < dwte.shape[0]:
        start, end = offsets[v], offsets[v + 1]
        if c < dout.shape[1] and end > start:
            acc = dwte[v, c]
            for k in range(start, end):
                acc += dout[order[k], c]
            dwte[v, c] = acc
        v += cuda.gridDim.x

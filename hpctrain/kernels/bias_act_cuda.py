"""The CUDA kernels of bias_act.py (its contract in its docstring), compiling the twin's activation
functions (``bias_act.activations``) per dtype. Launched by bias_act.py.

forward: threads across the columns, block rows over the rows (no index division per
element), four rows loaded before any is stored (cuda_support.UNROLL). backward: a block
of 32 columns x 8 row lanes sums up to 128 rows of dz into a float64 partial per column;
the last block of a column tile to finish (an integer ticket per tile) then adds the
partials in chunk order, in the same launch: no float atomics, the same bits every run.
"""

from __future__ import annotations

from functools import lru_cache

from numba import cuda, float64, int32

from .support.column_sums_cuda import last_block_of_column, sum_column_partials

COLS = 32          # backward block: 32 columns (one warp, coalesced rows) ...
LANES = 8          # ... x 8 row lanes
ROWS_PER_BLOCK = 128  # rows one backward block sums; partial sums go to scratch


@lru_cache(maxsize=None)
def bias_act_kernels(act_fn, grad_fn):
    """(forward, backward) kernels of one activation: ``act_fn`` and its derivative ``grad_fn``, plain
    functions of one dtype (bias_act.activations; passed in because bias_act.py imports this
    module), compiled here for the GPU."""
    act, grad = cuda.jit(device=True)(act_fn), cuda.jit(device=True)(grad_fn)

    @cuda.jit
    def forward(z, b, out):
        # threads across columns, block rows over rows (row_grid): no index division per
        # element, and UNROLL (4) rows loaded before any is stored (cuda_support.UNROLL)
        B, O = z.shape
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if c >= O:
            return
        bc = b[c]
        s = cuda.gridDim.y
        r = cuda.blockIdx.y
        while r + 3 * s < B:
            t0 = z[r, c] + bc
            t1 = z[r + s, c] + bc
            t2 = z[r + 2 * s, c] + bc
            t3 = z[r + 3 * s, c] + bc
            z[r, c] = t0
            z[r + s, c] = t1
            z[r + 2 * s, c] = t2
            z[r + 3 * s, c] = t3
            out[r, c] = act(t0)
            out[r + s, c] = act(t1)
            out[r + 2 * s, c] = act(t2)
            out[r + 3 * s, c] = act(t3)
            r += 4 * s
        while r < B:
            t = z[r, c] + bc
            z[r, c] = t
            out[r, c] = act(t)
            r += s

    @cuda.jit
    def backward(dout, z, dz, partial, counters, db, accumulate):
        # block (COLS, LANES) owns columns c0..c0+31 of rows [r0, r0 + ROWS_PER_BLOCK); a
        # lane's rows go four at a time, loaded before any dz is stored (cuda_support.UNROLL)
        # and added to s in row order, as one at a time would
        B, O = z.shape
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        c = cuda.blockIdx.x * COLS + tx
        r0 = cuda.blockIdx.y * ROWS_PER_BLOCK
        acc = cuda.shared.array((LANES, COLS), float64)
        last = cuda.shared.array(1, int32)
        s = 0.0
        if c < O:
            end = min(B, r0 + ROWS_PER_BLOCK)
            r = r0 + ty
            while r + 3 * LANES < end:
                g0, g1 = dout[r, c], dout[r + LANES, c]
                g2, g3 = dout[r + 2 * LANES, c], dout[r + 3 * LANES, c]
                v0, v1 = z[r, c], z[r + LANES, c]
                v2, v3 = z[r + 2 * LANES, c], z[r + 3 * LANES, c]
                d0, d1, d2, d3 = g0 * grad(v0), g1 * grad(v1), g2 * grad(v2), g3 * grad(v3)
                dz[r, c] = d0
                dz[r + LANES, c] = d1
                dz[r + 2 * LANES, c] = d2
                dz[r + 3 * LANES, c] = d3
                s += d0
                s += d1
                s += d2
                s += d3
                r += 4 * LANES
            while r < end:
                d = dout[r, c] * grad(z[r, c])
                dz[r, c] = d
                s += d
                r += LANES
        acc[ty, tx] = s
        cuda.syncthreads()
        # tree over the row lanes: fixed order, so the result is deterministic
        half = LANES // 2
        while half > 0:
            if ty < half:
                acc[ty, tx] += acc[ty + half, tx]
            cuda.syncthreads()
            half //= 2
        if ty == 0 and c < O:
            partial[cuda.blockIdx.y, c] = acc[0, tx]
        if last_block_of_column(counters, last, tx + ty):
            if ty == 0 and c < O:
                s = sum_column_partials(partial, c)
                db[c] = db[c] + s if accumulate else s

    return forward, backward

"""Device functions for ordered column sums without float atomics (bias_act's and layernorm's
parameter gradients): :func:`last_block_of_column` (a ticket per column tile; the last block adds
the partials) and :func:`sum_column_partials`. Imported by the kernel modules only."""

from __future__ import annotations

from numba import cuda, float64


@cuda.jit(device=True)
def last_block_of_column(counters, flag, leader):
    """True in every thread of the block that is the last of its column (``blockIdx.x``) of
    blocks to get here, over ``gridDim.y`` blocks; that block then owns the column's final
    sum (reading the others' partials) and the counter is already reset for the next launch.
    Call after writing the block's partials, from every thread (it has barriers); ``flag`` is
    a shared int32[1], ``leader`` 0 in one thread. The fence orders each thread's partial
    stores before its block's ticket: the last block sees every partial (the CUDA
    programming guide's threadFenceReduction pattern), and the sum it forms is in chunk
    order, not arrival order: the same bits every run."""
    cuda.threadfence()
    cuda.syncthreads()
    if leader == 0:
        ticket = cuda.atomic.add(counters, cuda.blockIdx.x, 1)
        flag[0] = 1 if ticket == cuda.gridDim.y - 1 else 0
        if flag[0] == 1:
            counters[cuda.blockIdx.x] = 0
    cuda.syncthreads()
    return flag[0] == 1


@cuda.jit(device=True)
def sum_column_partials(partial, c):
    """sum over g of partial[g, c] (float64) in g order, four loaded ahead of their adds (UNROLL)."""
    n = partial.shape[0]
    s = float64(0.0)
    g = 0
    while g + 3 < n:
        p0, p1, p2, p3 = partial[g, c], partial[g + 1, c], partial[g + 2, c], partial[g + 3, c]
        s += p0
        s += p1
        s += p2
        s += p3
        g += 4
    while g < n:
        s += partial[g, c]
        g += 1
    return s

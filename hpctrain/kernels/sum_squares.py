"""Sum of squares of a buffer, in float64 and in a fixed order: a gradient norm's share of one rank.

Gradient clipping (optim.clip_grad_norm) adds up every averaged gradient element's square over all
ranks; a rank's elements are a few ranges of the flat gradient, so the op takes a list of buffers
and answers once (on a GPU: one copy to the host and one wait for all of them). The sum is float64 whatever the buffer's dtype (float32 squares summed in float32 would
lose log2(P) bits over P parameters), and its order depends only on the buffer's length, never on
thread counts or timing, so a clipped run gives the same bits on every run, as an unclipped one does.

CPU: one numba pass, eight chains (lane i % 8, combined pairwise), on the calling thread (one read
of the buffer, like the finite test). CUDA: a fixed grid of at most :data:`BLOCKS` blocks; each
thread sums its grid-stride elements in float64, each block adds its threads' sums in a fixed tree
in shared memory, and the host adds the blocks' partial sums in block order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .support.cuda_support import THREADS, blocks_for, configured
from .support.lazy_import import lazy_import

cuda = lazy_import("numba.cuda")  # imported at the first launch
kernels = lazy_import(f"{__package__}.sum_squares_cuda")  # the CUDA kernels launched here (imported at the first launch)

BLOCKS = 256   # the most blocks (partial sums) of the CUDA reduction: its grid depends on the length only


# ---- CPU twin (numba) --------------------------------------------------------------
@njit(cache=True, nogil=True)
def _sum_squares(x):
    s = np.zeros(8)
    n = x.size
    n8 = n - n % 8
    for i in range(0, n8, 8):
        for lane in range(8):
            v = np.float64(x[i + lane])
            s[lane] += v * v
    for i in range(n8, n):
        v = np.float64(x[i])
        s[0] += v * v
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))


def sum_squares(bufs) -> float:
    """The float64 sum of the squares of the elements of every buffer in ``bufs`` (any shapes,
    contiguous): each buffer's sum in its fixed order, the buffers' sums added in turn."""
    total = 0.0
    for buf in bufs:
        total += float(_sum_squares(buf.reshape(-1)))
    return total


def sum_squares_each(groups) -> list[float]:
    """:func:`sum_squares` of each list of buffers in ``groups``, in a list (LAMB's and LARS's norms per
    parameter: on a GPU all of them with one copy to the host and one wait)."""
    return [sum_squares(bufs) for bufs in groups]


# ---- launchers ---------------------------------------------------------------------
def sum_squares_cuda(bufs, *, stream=0, scratch=None) -> float:
    """:func:`sum_squares` of device buffers: one launch per buffer, each into its own row of
    partial sums, then one copy to the host and one wait for the stream (the answer goes to the
    host), the rows added in turn. ``scratch``: the device's lender of the partial sums (None: a
    new array per call)."""
    return sum_squares_each_cuda([bufs], stream=stream, scratch=scratch)[0]


def sum_squares_each_cuda(groups, *, stream=0, scratch=None) -> list[float]:
    """:func:`sum_squares_each` of device buffers: every buffer of every group launched into its own
    row of partial sums, one copy to the host and one wait for all of them; each group's rows added
    in turn (the bits of :func:`sum_squares_cuda` per group)."""
    groups = [list(bufs) for bufs in groups]
    bufs = [buf for group in groups for buf in group]
    if not bufs:
        return [0.0] * len(groups)
    shape = (len(bufs), BLOCKS)
    partials = (cuda.device_array(shape, np.float64, stream=stream) if scratch is None
                else scratch("sum_squares_partials", shape, np.float64))
    used = []
    for row, buf in enumerate(bufs):
        blocks = max(1, min(BLOCKS, blocks_for(buf.size)))
        configured(kernels.sum_squares_kernel, blocks, THREADS, stream)(buf.reshape(buf.size), partials[row])
        used.append(blocks)
    host = partials.copy_to_host(stream=stream)
    stream.synchronize() if stream else cuda.synchronize()
    out, row = [], 0
    for group in groups:
        total = 0.0
        for _ in group:
            total += float(np.add.reduce(host[row, :used[row]]))
            row += 1
        out.append(total)
    return out

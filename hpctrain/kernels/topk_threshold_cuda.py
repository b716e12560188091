"""The CUDA kernels of topk_threshold.py: the strided sample of |x| and the threshold compaction
(candidates appended by an integer atomic). Launched by topk_threshold.py.
"""

from __future__ import annotations

from numba import cuda


@cuda.jit
def sample_abs_kernel(x, stride, out):
    j = cuda.grid(1)
    while j < out.size:
        out[j] = abs(x[j * stride])
        j += cuda.gridsize(1)


@cuda.jit
def threshold_compact_kernel(x, t, cand_idx, cand_val, count):
    i = cuda.grid(1)
    while i < x.size:
        v = x[i]
        a = abs(v)
        if a >= t or a != a:
            slot = cuda.atomic.add(count, 0, 1)
            if slot < cand_idx.size:
                cand_idx[slot] = i
                cand_val[slot] = v
        i += cuda.gridsize(1)

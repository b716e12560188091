"""Top-k selection by threshold: the device half of hpctrain/compress/sparse.py's TopK.

The order (both targets, and the host TopK): larger |x| first, NaN above every number; equal |x| by
smaller index. The top k of that order, indices ascending, is "the" top-k: no partition internals.

  topk_select        host (NumPy): the top k of a vector by partition, O(n); the reference, and the
                     selection among candidates
  topk_host          host (numba): the threshold search below with the compaction's CPU twin
  sample_abs         out[j] = |x[j * stride]|: a deterministic, strided sample
  threshold_compact  every i with |x[i]| >= t (or NaN) -> (cand_idx, cand_val) through an atomic
                     counter (the twin: index order); ``count`` = how many passed, even beyond capacity
  topk_cuda          the whole selection for a device vector x (n,) float32:
    1. sample SAMPLE entries; pick t so that about 2k of n pass (never 0, so zeros need not pass);
    2. compact on the device; if k <= count <= capacity (4k + 64) every entry at least the k-th
       largest passed, so the candidates, copied to the host, sorted by index (the atomics' order
       then does not matter) and run through topk_select, give the exact answer;
    3. too few pass: want 4x as many; too many: a quarter; after MAX_PASSES compactions, or when
       the sample cannot tell thresholds apart, the fallback: the whole vector to the host.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from numba import njit

from .support.cuda_support import THREADS, blocks_for, configured, configured_elementwise
from .support.lazy_import import lazy_import

cuda = lazy_import("numba.cuda")  # imported at the first launch
kernels = lazy_import(f"{__package__}.topk_threshold_cuda")  # the CUDA kernels launched here (imported at the first launch)

SAMPLE = 4096        # sampled entries: the threshold's passing count is within ~15 % at k/n = 1 %
MAX_PASSES = 4       # compactions before the whole vector goes to the host
TINY = np.float32(np.finfo(np.float32).smallest_subnormal)   # the lowest threshold: excludes zeros

TopkResult = namedtuple("TopkResult", "indices values passes fallback")


def capacity(n: int, k: int) -> int:
    """Candidates kept per compaction."""
    return min(n, 4 * k + 64)


# ---- CPU twins and the host selection (NumPy, numba) ----------------------------------
def topk_select(x, k):
    """Positions (int64, ascending) of the top k of ``x`` in the order above."""
    n = x.size
    if k >= n:
        return np.arange(n)
    if k <= 0:
        return np.zeros(0, np.int64)
    a = np.abs(x)
    kth = np.partition(a, n - k)[n - k]       # the k-th largest magnitude (NaN sorts last)
    if np.isnan(kth):
        return np.flatnonzero(np.isnan(a))[:k]
    above = np.flatnonzero((a > kth) | np.isnan(a))   # fewer than k
    ties = np.flatnonzero(a == kth)[:k - above.size]  # the smallest indices of the k-th magnitude
    return np.sort(np.concatenate([above, ties]))


def sample_abs(x, s):
    """|x| at s evenly strided positions (stride n // s)."""
    return np.abs(x[::x.size // s][:s]) if s else np.zeros(0, x.dtype)


@njit(cache=True, nogil=True)
def threshold_compact(x, t, cand_idx, cand_val):
    """The twin of the kernel, in index order; returns how many passed."""
    count = 0
    for i in range(x.size):
        a = abs(x[i])
        if a >= t or a != a:
            if count < cand_idx.size:
                cand_idx[count] = i
                cand_val[count] = x[i]
            count += 1
    return count


def threshold_for(sorted_sample, n, want):
    """t such that about ``want`` of n entries have |x| >= t, from the ascending sample (NaN as inf)."""
    s = sorted_sample.size
    m = min(s, max(1, math.ceil(want * s / n)))
    return max(np.float32(sorted_sample[s - m]), TINY)


# ---- launchers ---------------------------------------------------------------------
def _alloc(scratch, key, shape, dtype):
    return scratch(key, shape, dtype) if scratch is not None else cuda.device_array(shape, dtype)


def threshold_compact_cuda(x, t, cand_idx, cand_val, count, *, stream=0):
    """Launch the compaction; ``count`` (1,) int32 must hold 0. Returns nothing (read count after a sync)."""
    compact = configured(kernels.threshold_compact_kernel, blocks_for(x.size), THREADS, stream)
    compact(x, np.float32(t), cand_idx, cand_val, count)


def topk_cuda(x, k, *, stream=0, scratch=None) -> TopkResult:
    """The top k of the device vector x (n,) float32: host int32 indices (ascending) and float32 values.

    ``passes`` counts compactions, ``fallback`` says the whole vector went to the host.
    Synchronises ``stream`` (the host needs the counts).
    """
    n = x.size
    if k >= n:
        return TopkResult(np.arange(n, dtype=np.int32), x.copy_to_host(stream=stream), 0, False)
    s = min(n, SAMPLE)
    sample = _alloc(scratch, "topk_sample", (s,), np.float32)
    configured_elementwise(kernels.sample_abs_kernel, s, stream)(x, n // s, sample)
    host = sample.copy_to_host(stream=stream)
    _sync(stream)
    cap = capacity(n, k)
    cand_idx = _alloc(scratch, "topk_idx", (cap,), np.int32)
    cand_val = _alloc(scratch, "topk_val", (cap,), np.float32)
    count = _alloc(scratch, "topk_count", (1,), np.int32)

    def compact(t):
        count.copy_to_device(np.zeros(1, np.int32), stream=stream)
        threshold_compact_cuda(x, t, cand_idx, cand_val, count, stream=stream)
        c = int(count.copy_to_host(stream=stream)[0])
        _sync(stream)
        return c

    passes, c = threshold_passes(host, n, k, compact)
    if c is not None:
        ci, cv = cand_idx[:c].copy_to_host(stream=stream), cand_val[:c].copy_to_host(stream=stream)
        _sync(stream)
        order = np.argsort(ci, kind="stable")
        ci, cv = ci[order], cv[order]
        pos = topk_select(cv, k)
        return TopkResult(ci[pos], cv[pos], passes, False)
    values = x.copy_to_host(stream=stream)
    _sync(stream)
    pos = topk_select(values, k)
    return TopkResult(pos.astype(np.int32), values[pos], passes, True)


def threshold_passes(sample, n, k, compact):
    """The search both targets share: thresholds from the host ``sample`` of |x| (NaN ranks as
    inf) until ``compact(t)``, which compacts and returns how many passed, gives k <= count <=
    capacity. Returns (passes, count), count None when the search gave up (the fallback)."""
    ordered = np.sort(np.where(np.isnan(sample), np.float32(np.inf), sample))
    cap, want, tried = capacity(n, k), 2.0 * k, set()
    for passes in range(1, MAX_PASSES + 1):
        t = threshold_for(ordered, n, want)
        if t in tried:          # the sample cannot tell thresholds apart any finer (ties, zeros)
            break
        tried.add(t)
        c = compact(t)
        if k <= c <= cap:
            return passes, c
        want = want * 4 if c < k else want / 4
    return len(tried), None


def topk_host(x, k) -> TopkResult:
    """The top k of the host float32 vector x: int64 indices (ascending), their values, and how
    the threshold search went. The same set as :func:`topk_select`."""
    x = np.ascontiguousarray(x, np.float32)
    n = x.size
    if k >= n or k <= 0:
        pos = topk_select(x, k)
        return TopkResult(pos, x[pos], 0, False)
    s = min(n, SAMPLE)
    sample = sample_abs(x, s)
    cap = capacity(n, k)
    cand_idx, cand_val = np.empty(cap, np.int64), np.empty(cap, np.float32)
    passes, c = threshold_passes(sample, n, k, lambda t: threshold_compact(x, t, cand_idx, cand_val))
    if c is None:
        pos = topk_select(x, k)
        return TopkResult(pos, x[pos], passes, True)
    pos = topk_select(cand_val[:c], k)     # candidates are in index order: ties keep theirs
    return TopkResult(cand_idx[pos], cand_val[pos], passes, False)


def _sync(stream):
    if stream != 0:
        stream.synchronize()
    else:
        cuda.synchronize()

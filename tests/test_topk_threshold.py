"""Top-k selection (hpctrain/kernels/topk_threshold.py): the host selection (threshold search and
the compaction's numba twin) and the CUDA path each select exactly numpy.partition's set, by the
same roads (fallback, passes), on adversarial inputs (tests/topk_cases.py); ties go to smaller
indices and NaN is largest.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.compress import TopK
from hpctrain.compress.sparse import k_of, unpack_indices
from hpctrain.kernels import topk_threshold
from hpctrain.kernels.topk_threshold import topk_host, topk_select
from kernel_checks import CTX, assert_same_bits, gradient, needs_cuda
from test_compress_core import same_bits
from topk_cases import TOPK_CASES, adversarial, expected_road

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf, NaN casts: on purpose


# ---- the host selection (NumPy, numba) ---------------------------------------------------
def _same_road(name, n, k, found):
    fallback, passes = expected_road(name, n, k)
    return found.fallback == fallback and (passes is None or found.passes == passes)


@pytest.mark.parametrize("name, n, ratio", TOPK_CASES)
def test_topk_host_selects_exactly_the_reference_set_by_the_same_roads(name, n, ratio):
    """topk_host (threshold search, the compaction's numba twin) against topk_select (numpy.partition)."""
    x = adversarial(name, n)
    k = k_of(ratio, n)
    found = topk_host(x, k)
    ref = topk_select(x, k)
    np.testing.assert_array_equal(found.indices, ref)
    assert same_bits(found.values, x[ref])
    assert _same_road(name, n, k, found), found


def test_topk_host_takes_any_float_vector_and_any_k():
    x64 = adversarial("nan_inf", 9000).astype(np.float64)
    strided = adversarial("normal", 18000)[::2]                # not contiguous
    for x in (x64, strided):
        for k in (0, 1, 90, x.size - 1, x.size, x.size + 3):
            found, ref = topk_host(x, k), topk_select(x, k)
            np.testing.assert_array_equal(found.indices, ref)
            assert same_bits(found.values, x.astype(np.float32)[ref]), k


# ---- CUDA against the host selection -----------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("name, n, ratio", TOPK_CASES)
def test_topk_cuda_selects_exactly_the_host_set(dev32, name, n, ratio):
    x = adversarial(name, n)
    k = k_of(ratio, n)
    ref = topk_threshold.topk_select(x, k)             # the reference: numpy.partition
    found = topk_threshold.topk_cuda(up(dev32, x), k, stream=dev32.stream, scratch=dev32.scratch)
    np.testing.assert_array_equal(found.indices, ref)
    assert_same_bits(found.values, x[ref])
    p = TopK(ratio).compress(x, CTX)                   # the host path, through its payload
    np.testing.assert_array_equal(unpack_indices(p["offsets"], p["block_counts"]), ref)
    assert_same_bits(p["values"], x[ref])
    assert found.indices.dtype == np.int32 and found.indices.size == k
    # which road it took: the adversarial inputs are built to take the retry and fallback roads
    fallback, passes = expected_road(name, n, k)
    assert found.fallback == fallback, found
    if passes is not None:
        assert found.passes == passes, found


@needs_cuda
def test_topk_order_ties_go_to_smaller_indices_and_nan_is_largest():
    x = np.array([1.0, -2.0, 2.0, np.nan, 0.5, -2.0, 2.0], np.float32)
    np.testing.assert_array_equal(topk_threshold.topk_select(x, 1), [3])          # NaN above all
    np.testing.assert_array_equal(topk_threshold.topk_select(x, 3), [1, 2, 3])    # first two of four 2s
    np.testing.assert_array_equal(topk_threshold.topk_select(x, 6), [0, 1, 2, 3, 5, 6])
    p = TopK(3 / 7).compress(x, CTX)
    np.testing.assert_array_equal(unpack_indices(p["offsets"], p["block_counts"]), [1, 2, 3])


@needs_cuda
@pytest.mark.parametrize("n", [1, 7, 4097])
def test_threshold_compaction_finds_the_twins_set(dev32, n):
    x = adversarial("nan_inf", n) if n > 400 else gradient(n)
    t = np.float32(min(0.7, np.nanmax(np.abs(x))))
    cap = n
    ref_i, ref_v = np.empty(cap, np.int32), np.empty(cap, np.float32)
    count = topk_threshold.threshold_compact(x, t, ref_i, ref_v)
    I, V, C = dev32.empty(cap, np.int32), dev32.empty(cap), up(dev32, np.zeros(1, np.int32))
    topk_threshold.threshold_compact_cuda(up(dev32, x), t, I, V, C, stream=dev32.stream)
    assert int(dev32.to_host(C)[0]) == count > 0
    got_i, got_v = dev32.to_host(I)[:count], dev32.to_host(V)[:count]
    order = np.argsort(got_i)          # atomics hand out slots in any order
    np.testing.assert_array_equal(got_i[order], ref_i[:count])
    assert_same_bits(got_v[order], ref_v[:count])

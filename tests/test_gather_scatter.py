"""Sparse payloads' take and scatter (hpctrain/kernels/gather_scatter.py): the CUDA kernels bit for
bit the NumPy twins, inf and NaN entries included (tolerance: none, kernel_checks.py says why).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.kernels import gather_scatter
from kernel_checks import assert_same_bits, assert_same_bits_gpu, gradient, needs_cuda

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf, NaN casts: on purpose


@needs_cuda
@pytest.mark.parametrize("n", [1, 7, 4097])
def test_sparse_take_and_scatter_match_twins(dev32, n):
    r0 = gradient(n)
    r0[0] = np.inf
    idx = np.sort(np.random.default_rng(n).choice(n, size=max(1, n // 3), replace=False)).astype(np.int32)
    r_ref, v_ref = r0.copy(), np.empty(idx.size, np.float32)
    gather_scatter.sparse_take(r_ref, idx, v_ref)
    R, V, I = up(dev32, r0), dev32.empty(idx.size), up(dev32, idx)
    gather_scatter.sparse_take_cuda(R, I, V, stream=dev32.stream)
    assert_same_bits(dev32.to_host(V), v_ref)
    assert_same_bits_gpu(dev32.to_host(R), r_ref)     # inf - inf: NaN
    base = gradient(n, 2).astype(np.float64)
    for accumulate in (False, True):
        ref = gather_scatter.sparse_scatter(base.copy(), idx, v_ref, accumulate)
        OUT = up(dev32, base)
        gather_scatter.sparse_scatter_cuda(OUT, I, V, accumulate, stream=dev32.stream)
        assert_same_bits(dev32.to_host(OUT), ref)

"""Error feedback's elementwise steps (hpctrain/kernels/ef.py): the CUDA kernels bit for bit the
NumPy twins (tolerance: none, kernel_checks.py says why).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.kernels import ef
from kernel_checks import SIZES, assert_same_bits, gradient, needs_cuda

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf, NaN casts: on purpose


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", SIZES)
def test_elementwise_ef_steps_match_twins(dev32, n, dtype):
    x, r0, a = gradient(n).astype(dtype), gradient(n, 1), gradient(n, 2)
    R = up(dev32, r0)
    ef.ef_correct_cuda(up(dev32, x), R, stream=dev32.stream)
    assert_same_bits(dev32.to_host(R), ef.ef_correct(x, r0.copy()))
    ef.lowrank_residual_cuda(R, up(dev32, a), 3, stream=dev32.stream)
    assert_same_bits(dev32.to_host(R), ef.lowrank_residual(ef.ef_correct(x, r0.copy()), a, 3))
    OUT = dev32.empty(n, dtype)
    ef.cast_copy_cuda(R, OUT, stream=dev32.stream)
    assert_same_bits(dev32.to_host(OUT), ef.cast_copy(dev32.to_host(R), np.empty(n, dtype)))
    ef.fill_cuda(OUT, 0, stream=dev32.stream)
    assert_same_bits(dev32.to_host(OUT), np.zeros(n, dtype))

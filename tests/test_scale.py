"""The scale op (hpctrain/kernels/scale.py): buf *= factor, the CUDA kernel bit for bit the twin
(one multiplication by the same dtype-rounded factor).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.device import CudaDevice
from hpctrain.kernels import scale
from kernel_checks import needs_cuda, rng_cuda


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scale_matches_twin_exactly(dtype):
    dev = CudaDevice(dtype)
    x = rng_cuda(8).standard_normal(1700).astype(dtype)  # > 3 simulated grid strides: four-element steps
    X = up(dev, x)
    dev.ops.scale(X, 1.0 / 3.0)
    # one multiplication by the same dtype-rounded factor: bitwise equal
    np.testing.assert_array_equal(dev.to_host(X), scale.scale(x.copy(), 1.0 / 3.0))

"""LAMB's direction (hpctrain/kernels/lamb.py): the CPU twin against NumPy (the moments only
read), and the CUDA kernel against the twin. LAMB itself is tests/test_layerwise.py's.
"""

from __future__ import annotations

import numpy as np
import pytest


# ---- CPU twin (numba) --------------------------------------------------------------------
def test_lamb_direction_kernel_against_numpy():
    from hpctrain.kernels import lamb

    rng = np.random.default_rng(7)
    p, g, m, v = rng.standard_normal(101), rng.standard_normal(101), rng.standard_normal(101), rng.random(101)
    m0, v0 = m.copy(), v.copy()
    out = np.empty(101)
    lamb.lamb_direction(p, g, m, v, lamb.hyperparameters(np.float64, 3, 0.9, 0.99, 1e-8, 0.1), out)
    mm, vv = 0.9 * m0 + 0.1 * g, 0.99 * v0 + 0.01 * g * g
    want = (mm / (1 - 0.9 ** 3)) / (np.sqrt(vv / (1 - 0.99 ** 3)) + 1e-8) + 0.1 * p
    np.testing.assert_allclose(out, want, rtol=1e-13)
    np.testing.assert_array_equal(m, m0)   # the moments are only read
    np.testing.assert_array_equal(v, v0)


# ---- CUDA kernel against the twin --------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_lamb_direction_cuda_equals_the_cpu_twin(dtype):
    from hpctrain.device import CudaDevice, cuda_status
    from hpctrain.kernels import lamb

    if cuda_status()[0] == 0:
        pytest.skip("numba.cuda unusable")
    dev = CudaDevice(dtype)
    rng = np.random.default_rng(8)
    host = [rng.standard_normal(300).astype(dtype) for _ in range(3)] + [rng.random(300).astype(dtype)]
    hyper = lamb.hyperparameters(np.dtype(dtype), 2, 0.9, 0.999, 1e-8, 0.01)
    want = lamb.lamb_direction(*host, hyper, np.empty(300, dtype))
    arrays = [dev.from_host(a, a.dtype) for a in host]
    out = dev.zeros(300)
    dev.ops.lamb_direction(*arrays, dev.from_host(hyper, hyper.dtype), out)
    np.testing.assert_allclose(dev.to_host(out), want, rtol=1e-12 if dtype == "float64" else 2e-6)

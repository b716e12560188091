"""The finiteness check (hpctrain/kernels/finite.py): the twin's exact answer for NaN, +-Inf and
finite values whose squares overflow, and the CUDA kernel's against NumPy's.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import up
from hpctrain.device import CudaDevice
from kernel_checks import needs_cuda, rng_cuda


# ---- CPU twin (NumPy) --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_twin(dtype):
    from hpctrain.kernels.finite import all_finite

    x = np.random.default_rng(3).standard_normal(4099).astype(dtype)
    assert all_finite(x) is True
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[4098] = bad
        assert all_finite(y) is False
    # finite values whose squares overflow to inf are still finite: the exact test decides
    big = np.full(8, np.sqrt(np.finfo(dtype).max) * 2, dtype)
    assert not np.isfinite(np.dot(big, big)) and all_finite(big) is True
    # +inf and -inf whose sum is nan, and a 2-D buffer
    assert all_finite(np.array([[np.inf, -np.inf]], dtype)) is False


# ---- CUDA kernel -------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 517, 999])
def test_all_finite_matches_numpy(dtype, bad, where):
    dev = CudaDevice(dtype)
    x = rng_cuda(9).standard_normal(1000).astype(dtype)
    if bad is not None:
        x[where] = bad
    # the grid-stride loop must reach the last element too (2 blocks x 256 threads < 1000 in the simulator)
    assert dev.ops.all_finite(up(dev, x)) is bool(np.isfinite(x).all())

"""Sum of squares (hpctrain/kernels/sum_squares.py): the twin is the float64 sum in a fixed order,
and the CUDA reduction matches it (and gives each group's bits with one wait).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import up
from hpctrain.device import CudaDevice
from kernel_checks import needs_cuda, rng_cuda


# ---- CPU twin (numba) --------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1001])
def test_sum_squares_is_the_float64_sum_in_a_fixed_order(n):
    from hpctrain.kernels.sum_squares import sum_squares

    x = (1e3 * np.random.default_rng(n).standard_normal(n)).astype(np.float32)
    want = float(np.sum(x.astype(np.float64) ** 2))
    got = sum_squares([x])
    assert math.isclose(got, want, rel_tol=1e-13, abs_tol=0.0)   # float64 rounding of n positive terms
    assert sum_squares([x.reshape(-1, 1)]) == got   # shape does not matter, only the order of elements
    assert math.isclose(sum_squares([x[:n // 2], x[n // 2:]]), want, rel_tol=1e-13) and sum_squares([]) == 0.0


# ---- CUDA kernel against the twin --------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sum_squares_matches_the_cpu_twin_and_float64(dtype):
    from hpctrain.kernels.sum_squares import sum_squares

    dev = CudaDevice(dtype)
    x = rng_cuda(10).standard_normal(1000).astype(dtype)   # 2 blocks of 256 in the simulator, 4 on a GPU
    parts = [x[:1], x[1:700], x[700:]]
    got = dev.ops.sum_squares([up(dev, p) for p in parts])
    want = float(np.sum(x.astype(np.float64) ** 2))
    assert math.isclose(got, want, rel_tol=1e-13) and math.isclose(got, sum_squares(parts), rel_tol=1e-13)
    assert dev.ops.sum_squares([up(dev, x[:1])]) == float(x[0]) ** 2 and dev.ops.sum_squares([]) == 0.0


@needs_cuda
def test_sum_squares_each_gives_each_groups_bits_with_one_wait(monkeypatch):
    """LAMB's and LARS's norms per parameter: every group's sum as sum_squares gives it alone (the same
    partial sums, added in the same order), with one copy to the host and one wait for all of them."""
    from numba import cuda

    from hpctrain.kernels.sum_squares import sum_squares_each

    dev = CudaDevice("float32")
    x = rng_cuda(11).standard_normal(1300).astype(np.float32)
    groups = [[x[:1], x[1:700]], [], [x[700:]], [x[5:9], x[900:], x[:600]]]
    alone = [dev.ops.sum_squares([up(dev, p) for p in g]) for g in groups]
    staged = [[up(dev, p) for p in g] for g in groups]
    dev.synchronize()
    waits = []
    for owner in (cuda, dev.stream):   # a wait for the device, whichever way the op takes it
        real = owner.synchronize
        monkeypatch.setattr(owner, "synchronize", lambda real=real: waits.append(1) or real())
    got = dev.ops.sum_squares_each(staged)
    assert got == alone and got[1] == 0.0 and len(waits) == 1
    assert got == sum_squares_each(groups) or all(math.isclose(a, b, rel_tol=1e-13)
                                                  for a, b in zip(got, sum_squares_each(groups)))
    assert dev.ops.sum_squares_each([]) == [] and dev.ops.sum_squares_each([[], []]) == [0.0, 0.0]

"""hpctrain.testing.simulator: numba's CUDA simulator as the tests run it (a block's threads as
greenlets switched at each barrier). A kernel that needs the barrier gets the GPU's answer, a
thread that leaves early does not hold the others, syncthreads_count counts the block, and an
exception in one thread is raised with that thread named, without a hang."""

import numpy as np
import pytest
from numba import cuda   # a module global: the simulator swaps it in the kernels' globals

from hpctrain.device import simulated

pytestmark = [pytest.mark.skipif(not simulated(), reason="the simulator's tool (a GPU needs none)"),
              pytest.mark.timeout(60)]


def _kernels():
    @cuda.jit
    def block_sums(x, out, counts):
        """Each block sums its 64 values by halving in shared memory (wrong without the barrier:
        a thread reads a cell its partner has not written yet)."""
        cells = cuda.shared.array(64, np.float64)
        t = cuda.threadIdx.x
        cells[t] = x[cuda.blockIdx.x * 64 + t]
        cuda.syncthreads()
        half = 32
        while half > 0:
            if t < half:
                cells[t] += cells[t + half]
            cuda.syncthreads()
            half //= 2
        n = cuda.syncthreads_count(x[cuda.blockIdx.x * 64 + t] > 0)
        if t == 0:
            out[cuda.blockIdx.x] = cells[0]
            counts[cuda.blockIdx.x] = n

    @cuda.jit
    def early_exit(x, out):
        """Odd threads leave before the barrier; the even ones read their neighbour's cell after it."""
        cells = cuda.shared.array(32, np.float64)
        t = cuda.threadIdx.x
        cells[t] = x[t]
        if t % 2 == 1:
            return
        cuda.syncthreads()
        out[t] = cells[t] + cells[t + 1]

    @cuda.jit
    def fails(x):
        t = cuda.threadIdx.x
        cuda.syncthreads()
        x[t] = 1.0 / 0 if t == 5 else 0.0

    return block_sums, early_exit, fails


def test_a_blocks_barrier_gives_the_gpus_answer_with_greenlets():
    from numba.cuda.simulator import kernel as sim

    from hpctrain.testing.simulator import make_thread_safe

    make_thread_safe()
    assert sim.BlockManager._hpctrain_greenlets
    block_sums, early_exit, _ = _kernels()
    x = np.random.default_rng(0).standard_normal(3 * 64)
    out, counts = np.zeros(3), np.zeros(3, np.int64)
    block_sums[3, 64](x, out, counts)
    np.testing.assert_allclose(out, x.reshape(3, 64).sum(axis=1), rtol=1e-12)
    assert counts.tolist() == (x.reshape(3, 64) > 0).sum(axis=1).tolist()
    y, pairs = np.arange(32.0), np.zeros(32)
    early_exit[1, 32](y, pairs)
    assert pairs[0::2].tolist() == (y[0::2] + y[1::2]).tolist() and not pairs[1::2].any()


def test_an_exception_in_one_thread_names_it_and_ends_the_launch():
    from hpctrain.testing.simulator import make_thread_safe

    make_thread_safe()
    _, _, fails = _kernels()
    with pytest.raises(ZeroDivisionError, match=r"tid=\[5, 0, 0\] ctaid=\[0, 0, 0\]"):
        fails[2, 8](np.zeros(8))
    block_sums, _, _ = _kernels()   # the next launch runs as usual
    out, counts = np.zeros(1), np.zeros(1, np.int64)
    block_sums[1, 64](np.ones(64), out, counts)
    assert out[0] == 64.0 and counts[0] == 64

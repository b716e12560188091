"""All-reduce strategies against closed-form answers and against each other (mpirun -n 1..4)."""

import numpy as np
import pytest

from hpctrain.device import CpuDevice
from hpctrain.comm import STRATEGIES, make_allreduce

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 7, 1000, 65537])
def test_rank_valued_inputs_have_closed_form_results(world, name, dtype, n):
    device = CpuDevice(dtype)
    allreduce = make_allreduce(name, world, device)
    buf = np.full(n, world.rank, dtype=dtype)
    allreduce(buf, "sum")
    assert np.all(buf == world.size * (world.size - 1) / 2)
    buf[:] = world.rank
    allreduce(buf, "mean")
    # (size-1)/2 is exact in binary for these sizes; the 1/size scale may round
    np.testing.assert_allclose(buf, (world.size - 1) / 2, rtol=np.finfo(dtype).eps * 4)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategies_agree_with_mpi_allreduce(world, name):
    from mpi4py import MPI

    rng = np.random.default_rng(world.rank)
    x = rng.standard_normal(12345)
    expected = np.empty_like(x)
    world.comm.Allreduce(x, expected, op=MPI.SUM)
    got = x.copy()
    make_allreduce(name, world, CpuDevice("float64"))(got, "mean")
    # summation order may differ between algorithms: a few ulps of the sum
    np.testing.assert_allclose(got, expected / world.size, rtol=1e-12, atol=1e-14)
    # every rank ends with the same bytes
    root = world.comm.bcast(got if world.rank == 0 else None, root=0)
    assert np.array_equal(got, root)

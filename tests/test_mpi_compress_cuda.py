"""The device path of gradient compression over several ranks (mpirun -n 2..4), on numba's
CUDA simulator: every rank's device path returns the host path's bits (the 16-bit ring,
the all-gathers and the all-reduces carry the same payloads, and the device decodes them
in the same order), and a trainer on device=cuda keeps all ranks identical and equal to
the host path. PowerSGD: within float32 rounding (GEMM kernels vs BLAS). Skipped under
mpirun -n 1: one rank's device path against its host path, every compressor, is
tests/test_compress_cuda.py's (MPI.COMM_SELF; the trainer there too), and the simulator makes
each run here cost; the fp16 trainer below runs at 2 and 4 ranks.
"""

import hashlib

import numpy as np
import pytest

from hpctrain.device import cuda_status
from steps import train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600),
              pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")]


@pytest.fixture(autouse=True)
def _several_ranks():
    from mpi4py import MPI

    if MPI.COMM_WORLD.size == 1:
        pytest.skip("one rank: tests/test_compress_cuda.py (see the module docstring)")

SPECS = ["fp16", "bf16", "topk(0.02)", "randk(0.1)", "sign", "powersgd(2)"]
SHAPES = [(40, 30), (30,), (30, 5)]
N = sum(int(np.prod(s)) for s in SHAPES)


def _identical(comm, a):
    digests = comm.allgather(hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
    assert len(set(digests)) == 1


@pytest.mark.parametrize("spec", SPECS)
def test_device_sum_equals_host_sum_on_every_rank(spec):
    from mpi4py import MPI

    from hpctrain.compress import Context, make_compressor
    from hpctrain.compress.device import DeviceCompressedSum
    from hpctrain.compress.reducer import CompressedSum
    from hpctrain.device import CudaDevice

    comm = MPI.COMM_WORLD
    dev = CudaDevice("float64")
    host, dsum = CompressedSum(comm, make_compressor(spec)), DeviceCompressedSum(comm, make_compressor(spec), dev)
    for step in range(2):
        ctx = Context(step=step, bucket=1, seed=4)
        g = np.random.default_rng([92, comm.rank, step]).standard_normal(N) * (comm.rank + 1)
        x = g.astype(np.float32)
        host(x, ctx, SHAPES)
        view = dev.from_host(g)
        dsum(view, ctx, SHAPES)
        got = dev.to_host(view)
        _identical(comm, got)
        if spec.startswith("powersgd"):
            np.testing.assert_allclose(got, x, rtol=0, atol=1e-5 * np.abs(x).max())
        else:
            np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32), x.view(np.uint32))
        assert dsum.sent_bytes == host.sent_bytes and dsum.dense_bytes == host.dense_bytes


def _config(train_path, spec):
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.data.train, cfg.data.eval = train_path, ""
    cfg.model.hidden = [16, 12]
    cfg.train.global_batch, cfg.train.dtype, cfg.train.device = 4, "float64", "cuda"  # few rows: fast softmax
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps = "adamw", 0.01, 0
    cfg.dist.compress, cfg.dist.bucket_mb = spec, 0        # one bucket
    return cfg.validate()


def test_trainer_on_cuda_with_fp16_on_the_device_equals_the_host_path(mpi_small_data):
    from mpi4py import MPI

    from hpctrain.compress.reducer import CompressedSum
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    world = init_world(MPI.COMM_WORLD)
    if 4 % world.size:
        pytest.skip("the global batch of 4 rows needs a world size dividing it")
    params = {}
    for path in ("device", "host"):
        t = Trainer(_config(mpi_small_data[0], "fp16"), world, Log(False))
        c = t.compression
        assert c.on_device
        if path == "host":
            c._sum, c.on_device = CompressedSum(world.comm, c.compressor), False
        for _ in range(2):
            train_step(t)
        params[path] = t.device.to_host(t.model.flat.data)
        _identical(world.comm, params[path])
    np.testing.assert_array_equal(params["device"], params["host"])

"""The device path of gradient compression (hpctrain/compress/device.py) against the host
path (compress/reducer.py), one rank (MPI.COMM_SELF), on numba's CUDA simulator.

Contract: for every compressor but PowerSGD the device path returns the host
path's bits, step after step, and keeps the same residuals (compared bit for
bit through the checkpoint view, ``state()``). PowerSGD's products run through
the GEMM kernels, which sum in another order than BLAS: held to float32
rounding of the products (rtol 1e-5 of the largest entry). Multi-rank sums:
tests/test_mpi_compress_cuda.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.compress import Context, make_compressor
from hpctrain.compress.device import DeviceCompressedSum
from hpctrain.compress.reducer import CompressedSum
from hpctrain.compress.sparse import INDEX_BLOCK
from hpctrain.device import CudaDevice, cuda_status
from steps import train_step

pytestmark = [pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}"),
              pytest.mark.timeout(300)]

EXACT = ["none", "fp16", "bf16", "topk(0.02)", "randk(0.1)", "sign"]
SHAPES = [(40, 30), (30,), (30, 5)]     # one bucket of three layers: 1380 values
N = sum(int(np.prod(s)) for s in SHAPES)


@pytest.fixture(scope="module")
def comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def grads(step, n=N, dtype="float64"):
    g = np.random.default_rng([91, step]).standard_normal(n) * 2.0 ** (step % 5 - 2)
    g[::97] = 0.0
    return g.astype(dtype)


def run_host(host, g, ctx, shapes=SHAPES):
    x = g.astype(np.float32)           # what GradientCompression does with a host bucket
    host(x, ctx, shapes)
    return x.astype(g.dtype)


def run_device(dev, dsum, g, ctx, shapes=SHAPES):
    view = dev.from_host(g, g.dtype)
    dsum(view, ctx, shapes)
    return dev.to_host(view)


def same_bits(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec", EXACT)
def test_device_path_equals_host_path_bitwise(comm, spec, dtype):
    dev = CudaDevice(dtype)
    host, dsum = CompressedSum(comm, make_compressor(spec)), DeviceCompressedSum(comm, make_compressor(spec), dev)
    for step in range(2):
        ctx = Context(step=step, bucket=2, seed=5)
        g = grads(step, dtype=dtype)
        assert same_bits(run_device(dev, dsum, g, ctx), run_host(host, g, ctx)), (spec, step)
    hs, ds = host.state(), dsum.state()
    assert sorted(hs) == sorted(ds) == ([] if spec == "none" else ["residual/2"])
    assert all(same_bits(ds[k], hs[k]) for k in hs)
    assert dsum.dense_bytes == host.dense_bytes and dsum.sent_bytes == host.sent_bytes == 0  # one rank


def test_topk_device_path_equals_host_path_past_one_index_block(comm):
    """Indices past 65535 travel as 16-bit offsets with per-block counts (compress/sparse.py);
    both paths decode them alike. A bucket of 2 blocks and a part, float32."""
    dev = CudaDevice("float32")
    n = 2 * INDEX_BLOCK + 300
    host, dsum = CompressedSum(comm, make_compressor("topk(0.001)")), \
        DeviceCompressedSum(comm, make_compressor("topk(0.001)"), dev)
    for step in range(2):
        ctx = Context(step=step, bucket=0, seed=5)
        g = grads(step, n, "float32")
        g[-300:] *= 1.5   # so that the short last block holds some of the top k (~8 of 132)
        got, ref = run_device(dev, dsum, g, ctx, [(n,)]), run_host(host, g, ctx, [(n,)])
        assert same_bits(got, ref), step
        assert {i // INDEX_BLOCK for i in np.flatnonzero(ref)} == {0, 1, 2}   # every block sent some
    assert same_bits(dsum.state()["residual/0"], host.state()["residual/0"])


@pytest.mark.parametrize("shapes", [SHAPES, [(40, 3, 10), (30,), (30, 5)]], ids=["matrices", "parts"])
def test_powersgd_device_path_is_the_host_path_to_rounding(comm, shapes):
    """Also for a layer of three parts side by side ((40, 3, 10): the device path's block-diagonal
    Q against the host path's part by part)."""
    dev = CudaDevice("float32")
    spec = "powersgd(2, 1)"               # step 0 exact (no residual), then compressed
    host, dsum = CompressedSum(comm, make_compressor(spec)), DeviceCompressedSum(comm, make_compressor(spec), dev)
    for step in range(3):
        ctx = Context(step=step, bucket=0, seed=5)
        g = grads(step, dtype="float32")
        got, ref = run_device(dev, dsum, g, ctx, shapes), run_host(host, g, ctx, shapes)
        if step == 0:
            assert same_bits(got, ref) and dsum.state() == {}
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    hs, ds = host.state(), dsum.state()
    assert sorted(hs) == sorted(ds) == ["q/0/0", "q/0/2", "residual/0/0", "residual/0/2"]  # (30,) is a vector
    for k in hs:
        assert hs[k].shape == ds[k].shape, k
        np.testing.assert_allclose(ds[k], hs[k], rtol=0, atol=1e-4 * np.abs(hs[k]).max())


@pytest.mark.parametrize("spec", ["fp16", "topk(0.01)", "randk(0.05)", "sign"])   # bf16: fp16's kernel
def test_error_feedback_invariant_through_the_device_path(comm, spec):
    """sum(sent) + final residual == sum(gradients), to float32 rounding (as test_compress_core's)."""
    dev = CudaDevice("float32")
    dsum = DeviceCompressedSum(comm, make_compressor(spec), dev)
    n, sent, total = 3000, np.zeros(3000), np.zeros(3000)
    for step in range(4):
        g = grads(step, n, "float32")
        sent += run_device(dev, dsum, g, Context(step=step, bucket=0, seed=1), [(n,)])
        total += g
    np.testing.assert_allclose(sent + dsum.state()["residual/0"], total, atol=1e-4 * np.abs(total).max())
    if spec.startswith("topk"):
        assert dsum.topk_passes >= 4 and dsum.topk_fallbacks == 0   # the threshold road, not the fallback


@pytest.mark.parametrize("spec", ["topk(0.02)", "sign", "powersgd(2)"])
def test_checkpointed_state_moves_between_device_and_host_paths(comm, spec):
    """state() of one path, loaded into the other, continues as the saving path would have."""
    dev = CudaDevice("float32")
    host, dsum = CompressedSum(comm, make_compressor(spec)), DeviceCompressedSum(comm, make_compressor(spec), dev)
    ctx = Context(step=0, bucket=0, seed=3)   # a device run and a host run, one step to a checkpoint
    run_device(dev, dsum, grads(0, dtype="float32"), ctx)
    run_host(host, grads(0, dtype="float32"), ctx)
    to_host = CompressedSum(comm, make_compressor(spec))
    to_device = DeviceCompressedSum(comm, make_compressor(spec), dev)
    to_host.load_state(dsum.state())      # a device checkpoint resumed on the host ...
    to_device.load_state(host.state())    # ... and a host checkpoint on the device
    ctx = Context(step=1, bucket=0, seed=3)
    g = grads(1, dtype="float32")
    pairs = [(run_host(to_host, g, ctx), run_device(dev, dsum, g, ctx)),
             (run_device(dev, to_device, g, ctx), run_host(host, g, ctx))]
    for (resumed, straight), (a, b) in zip(pairs, [(to_host, dsum), (to_device, host)]):
        if spec.startswith("powersgd"):   # GEMM vs BLAS: rounding apart
            np.testing.assert_allclose(resumed, straight, rtol=0, atol=1e-5 * np.abs(straight).max())
        else:
            assert same_bits(resumed, straight)
            sa, sb = a.state(), b.state()
            assert sorted(sa) == sorted(sb) and all(same_bits(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("spec", ["topk(0.02)", "powersgd(2)"])
def test_restore_takes_the_state_back_to_the_snapshot(comm, spec, path):
    """The guard's skip (GradientCompression.undo_step): snapshot(), a step with a NaN gradient, restore();
    the state is the snapshot's bit for bit, and the next step gives what it gives without the bad one.
    The device path swaps device buffers, so a second bad step and restore must work the same."""
    dev = CudaDevice("float32")
    make = (lambda: CompressedSum(comm, make_compressor(spec))) if path == "host" else \
        (lambda: DeviceCompressedSum(comm, make_compressor(spec), dev))
    # PowerSGD's bucket: one 16 x 15 matrix (240 values: one block per elementwise launch, one K slab
    # per GEMM). Its residual and its Q are what snapshot() and restore() copy and swap; SHAPES'
    # vector and second matrix only added simulated launches (~7 s; their paths are the tests
    # above). Top-k keeps the bucket of N values (it reads no shapes).
    n, shapes = (240, [(16, 15)]) if spec.startswith("powersgd") else (N, SHAPES)
    run = (lambda s, g, ctx: run_host(s, g, ctx, shapes)) if path == "host" else \
        (lambda s, g, ctx: run_device(dev, s, g, ctx, shapes))
    clean, skipped = make(), make()
    ctx = [Context(step=k, bucket=0, seed=3) for k in range(4)]
    for k in range(2):
        run(clean, grads(k, n, "float32"), ctx[k])
        run(skipped, grads(k, n, "float32"), ctx[k])
    before = {k: v.copy() for k, v in skipped.state().items()}
    for bad in range(2):                   # two bad steps in a row, each undone
        snap = skipped.snapshot()
        g = grads(9, n, "float32")
        g[5] = np.nan
        run(skipped, g, ctx[2])
        assert any(not np.isfinite(v).all() for v in skipped.state().values())  # the bad step got in
        skipped.restore(snap)
        after = skipped.state()
        assert sorted(after) == sorted(before) and all(same_bits(after[k], before[k]) for k in before), bad
    g = grads(2, n, "float32")
    assert same_bits(run(skipped, g, ctx[2]), run(clean, g, ctx[2]))
    a, b = skipped.state(), clean.state()
    assert sorted(a) == sorted(b) and all(same_bits(a[k], b[k]) for k in a)


def test_unknown_compressors_have_no_device_path(comm):
    from hpctrain.compress import Compressor

    with pytest.raises(TypeError, match="no device path"):
        DeviceCompressedSum(comm, Compressor(), CudaDevice("float32"))


# ---- inside the trainer ------------------------------------------------------------------------
def _config(train_path, spec):
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.data.train, cfg.data.eval = train_path, ""
    cfg.model.hidden = [16, 12]
    cfg.train.global_batch, cfg.train.dtype, cfg.train.device = 4, "float64", "cuda"  # a block per row in softmax
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps = "adamw", 0.01, 0
    cfg.dist.compress, cfg.dist.bucket_mb = spec, 0        # one bucket: every launch costs ~0.1 s here
    # overlap on (the default): the communication thread launches the compression kernels
    # while backward may launch its own; CudaDevice serialises simulator launches
    # (kernels/support/cuda_support.py), a GPU queues both on the device's one stream
    return cfg.validate()


def test_trainer_on_cuda_compresses_on_the_device_like_the_host_path(small_data, spec="topk(0.05)"):
    from mpi4py import MPI

    from hpctrain.compress.reducer import CompressedSum
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    world = init_world(MPI.COMM_SELF)
    params = {}
    for path in ("device", "host"):
        t = Trainer(_config(small_data[0], spec), world, Log(False))
        c = t.compression
        assert c.on_device and isinstance(c._sum, DeviceCompressedSum)
        if path == "host":                # the staging copies and the host compressor, as before
            c._sum, c.on_device = CompressedSum(world.comm, c.compressor), False
        for _ in range(2):
            train_step(t)
        params[path] = t.device.to_host(t.model.flat.data), {k: v.copy() for k, v in c.state().items()}
    (p_dev, s_dev), (p_host, s_host) = params["device"], params["host"]
    assert same_bits(p_dev, p_host)
    assert sorted(s_dev) == sorted(s_host) == ["residual/0"] and all(same_bits(s_dev[k], s_host[k]) for k in s_dev)


def test_trainer_on_cuda_with_momentum_correction_equals_the_cpu_trainer(small_data, spec="topk(0.05)"):
    """dist.compress_momentum on a CUDA device: the buckets are staged to the host path, which keeps the
    velocities, and AdamW's device kernel runs in velocity mode from compress_start_step on. Four steps
    (exact, then three compressed) equal the CPU trainer's to float64 rounding, parameters and
    velocities both; the velocities are really there and nonzero."""
    from mpi4py import MPI

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    world = init_world(MPI.COMM_SELF)
    out = {}
    for device in ("cuda", "cpu"):
        cfg = _config(small_data[0], spec)
        cfg.train.device = device
        cfg.optim.freeze_step = cfg.dist.compress_start_step = 1
        cfg.dist.compress_momentum = True
        t = Trainer(cfg.validate(), world, Log(False))
        assert not t.compression.on_device and t.optimizer.velocity_from == 1
        for _ in range(4):
            train_step(t)
        assert t.optimizer.velocity
        out[device] = t.device.to_host(t.model.flat.data), {k: v.copy() for k, v in t.compression.state().items()}
    (p_gpu, s_gpu), (p_cpu, s_cpu) = out["cuda"], out["cpu"]
    np.testing.assert_allclose(p_gpu, p_cpu, rtol=1e-10, atol=1e-12)
    assert sorted(s_gpu) == sorted(s_cpu) == ["residual/0", "velocity/0"]
    assert np.abs(s_cpu["velocity/0"]).max() > 0
    for k in s_cpu:
        np.testing.assert_allclose(s_gpu[k], s_cpu[k], rtol=1e-6, atol=1e-6 * np.abs(s_cpu[k]).max())


@pytest.mark.parametrize("spec", ["topk(0.05)", "powersgd(2)"])
def test_gpt_buckets_compress_on_the_device_like_the_host_path(comm, spec):
    """The GPT's gradient buckets (its matrices as PowerSGD's layers, in the flat buffer's order)
    through GradientCompression's device path and its host path, two steps: top-k bit for bit,
    PowerSGD to the float32 rounding of its products. (A whole simulated GPT step takes ~45 s
    here; the buckets are what compression sees of the model.)"""
    from hpctrain.comm import make_allreduce
    from hpctrain.comm.buckets import plan_buckets
    from hpctrain.compress.gradients import GradientCompression
    from hpctrain.comm.staging import Staging
    from hpctrain.models.gpt import GPT
    from hpctrain.runtime import init_world

    world, dev = init_world(comm), CudaDevice("float32")
    model = GPT(dev, 7, 3, 1, 2, 8)  # small: the simulator runs PowerSGD's GEMMs a Python thread per element
    buckets = plan_buckets(model.flat, 4, 0.0004, 0.0002)
    staging = Staging(dev)
    paths = [GradientCompression(spec, "all", world, staging, make_allreduce("mpi", world, dev, staging), buckets,
                                 model.flat, seed=3, matrix_parts=model.matrix_parts) for _ in range(2)]
    assert len(buckets) >= 3 and all(p.on_device for p in paths)
    host = paths[1]
    host._sum, host.on_device = CompressedSum(world.comm, host.compressor), False
    for step in range(2):  # the first Q, then the warm-started one
        g = grads(step, model.flat.size, "float32")
        out = []
        for path in paths:
            flat = dev.from_host(g, np.float32)
            for b in buckets:
                path.reduce(flat[b.lo:b.hi], b.index, step)
            out.append(dev.to_host(flat))
        if spec.startswith("topk"):
            assert same_bits(out[0], out[1]), step
        else:
            np.testing.assert_allclose(out[0], out[1], rtol=0, atol=1e-5 * np.abs(out[1]).max())
    s_dev, s_host = (p.state() for p in paths)
    assert sorted(s_dev) == sorted(s_host) and s_dev
    if spec.startswith("powersgd"):  # every matrix shrinks at rank 2, c_attn as its three parts
        shrunk = [sh for b in paths[0].shapes for sh in b if paths[0].compressor.compresses(sh)]
        assert sum(k.startswith("q/") for k in s_dev) == len(shrunk) == 6 and (8, 3, 8) in shrunk, shrunk

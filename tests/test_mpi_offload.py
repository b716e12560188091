"""``dist.offload = "optimizer"`` on the CUDA device (numba's simulator without a GPU), inside an MPI
job of 2 ranks: the optimizer's state and update in pinned host memory, with the CPU kernels.

The CPU kernels compute the CUDA kernels' formulas, and the simulator runs those in IEEE double
arithmetic as the CPU does: an offloaded run gives the bits of one that is not (float64, ring, one
micro-batch, so ZeRO 1-3 give zero 0's bits too: tests/test_mpi_zero3.py). Checked: AdamW offloaded
at zero 0, 1 and 3 against no offload at zero 0; LAMB with clipping at zero 2 against the same on
the device, to rounding (its norms are sums, added in another order by the CPU's kernel); a
checkpoint saved offloaded at zero 3 resumed at zero 0 without offload and at zero 1 with it. Runs
under mpirun -n 2 only (each simulated run takes seconds), on the text folded into a small
vocabulary (tests/test_mpi_gpt_cuda.py says why), one window a rank; the reference run and the one
offloaded at zero 3 (whose first step's checkpoint the resuming test reads) are made once a job.
"""

import os

import numpy as np
import pytest

from hpctrain.device import cuda_status
from steps import train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600),
              pytest.mark.skipif(cuda_status()[0] == 0, reason="numba.cuda unusable")]


def _run(text, world, zero, offload, steps=2, ckpt_dir="", resume="", optim="adamw", clip=0.0, precision="fp32"):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer
    from test_gpt_cuda_step import _config

    cfg = _config(text, "cuda", steps=steps)   # one block: d 6, context 5
    cfg.train.global_batch, cfg.train.eval_tokens = world.size, 0   # one window a rank
    cfg.optim.name, cfg.optim.clip_grad_norm = optim, clip
    cfg.dist.zero, cfg.dist.offload, cfg.dist.allreduce = zero, offload, "ring"
    cfg.dist.bucket_mb = cfg.dist.first_bucket_mb = 0.001   # several buckets, each cut in shares
    if precision != "fp32":   # 16-bit compute over float32 masters; zero 3 on its layer buckets
        cfg.train.precision, cfg.train.dtype, cfg.dist.bucket_split = precision, "float32", "layers"
        cfg.train.loss_scale = 1024.0   # fp16: no overflow here, so every step updates
    if ckpt_dir:
        cfg.checkpoint.dir, cfg.checkpoint.every_steps, cfg.checkpoint.keep_last = ckpt_dir, 1, 0
    cfg.checkpoint.resume = resume
    trainer = Trainer(cfg.validate(), world, Log(False))
    start = trainer.step
    for _ in range(start, steps):
        trainer.last_step = train_step(trainer)   # (the test's own record of the last step's result)
        if ckpt_dir:
            trainer.checkpoints.save(trainer.state)
    plan = trainer.plan
    params = (plan.param_slots.whole(plan.dp.comm) if plan.param_slots is not None
              else trainer.device.to_host(trainer.model.flat.data).copy())
    opt = trainer.optimizer
    sdev = getattr(opt, "state_device", trainer.device)
    state = {k: (opt.shards.gather(plan.dp.comm, sdev.to_host(v), trainer.model.flat.size) if opt.shards is not None
                 else np.array(sdev.to_host(v))) for k, v in opt.state().items()}
    trainer.close()
    return trainer, start, params, state


@pytest.fixture(scope="module")
def world():
    from mpi4py import MPI

    if MPI.COMM_WORLD.size != 2:
        pytest.skip("runs under mpirun -n 2 only (see the module docstring)")
    from hpctrain.runtime import init_world

    return init_world()


@pytest.fixture(scope="module")
def text(world, mpi_small_vocab_text):
    return mpi_small_vocab_text


@pytest.fixture(scope="module")
def on_device(world, text):
    """(parameters, state) of the run without offload at zero 0 (the reference of the AdamW tests)."""
    return _run(text, world, 0, "none")[2:]


@pytest.fixture(scope="module")
def offloaded_zero_3(world, text, mpi_shared_dir):
    """The AdamW run offloaded at zero 3, saved after each step (the checkpoint test resumes its first
    step's file): (its _run result, the checkpoint folder)."""
    folder = os.path.join(mpi_shared_dir, "offload-ckpt")
    run = _run(text, world, 3, "optimizer", ckpt_dir=folder)
    world.comm.Barrier()
    return run, folder


def test_offloaded_optimizer_gives_the_bits_of_the_device_one(world, text, on_device, offloaded_zero_3):
    """At zero 0 (the host holds every master), 1 (its chunks of the device's parameters) and 3 (the
    device's packed chunks): two steps, the second from the host's own masters."""
    from hpctrain.optim.offload import OffloadedOptimizer

    p0, s0 = on_device
    runs = {zero: _run(text, world, zero, "optimizer") for zero in (0, 1)}
    runs[3] = offloaded_zero_3[0]
    for zero, (trainer, _, p, s) in runs.items():
        assert isinstance(trainer.optimizer, OffloadedOptimizer)
        assert all(isinstance(v, np.ndarray) for v in trainer.optimizer.state().values())   # host memory
        assert np.array_equal(p, p0), zero
        assert all(np.array_equal(s[k], s0[k]) for k in s0), zero
    assert np.abs(p0).max() > 0 and np.abs(s0["exp_avg"]).max() > 0


@pytest.mark.parametrize("precision, stages", [("bf16", (0, 3)), ("fp16", (3,))])
def test_a_16_bit_run_offloads_its_float32_masters(world, text, precision, stages):
    """train.precision = bf16 or fp16: the host keeps the float32 masters and the state, the device the
    float32 parameters written back and the 16-bit copy the layers read; at zero 0 and 3 (its 16-bit
    slots gathered from the written-back chunks; fp16: the update waits for each step's verdict)
    against the same precision on the device at zero 0, bit for bit. At zero 3 this is also the
    device's check of ZeRO-3's 16-bit gathers: the gather thread rounding a float32 chunk into a 16-bit
    device slot (a narrowing kernel) and moving its bits through pinned buffers (fp16's float16 slot
    viewed as uint16). (Against zero 2 on the CPU, at 1-4 ranks: tests/test_mpi_zero3.py.)"""
    from hpctrain.optim.offload import OffloadedOptimizer

    _, _, p0, s0 = _run(text, world, 0, "none", precision=precision)
    assert p0.dtype == np.float32
    for zero in stages:
        trainer, _, p, s = _run(text, world, zero, "optimizer", precision=precision)
        assert isinstance(trainer.optimizer, OffloadedOptimizer) and trainer.optimizer.host_params.dtype == np.float32
        assert trainer.optimizer.t == 2, zero   # both steps updated (fp16: none overflowed)
        assert np.array_equal(p, p0), zero
        assert all(np.array_equal(s[k], s0[k]) for k in s0), zero
    assert np.abs(s0["exp_avg"]).max() > 0


def test_lamb_with_clipping_offloaded_at_zero_2(world, text):
    """LAMB (every gradient copied to the host before its trust ratios) with the gradient clipped on
    the device first, at zero 2 (the packed device gradients), against the same run on the device:
    equal to rounding, not bit for bit, as LAMB's norms are sums that the CPU's kernel and the
    device's add in different orders (the elementwise update itself is the same; AdamW above)."""
    trainer, _, p1, s1 = _run(text, world, 2, "optimizer", optim="lamb", clip=0.05)
    assert trainer.last_step.clip["grad_norm"] > 0.05   # the clip applied
    _, _, p0, s0 = _run(text, world, 2, "none", optim="lamb", clip=0.05)
    # (measured: parameters within 2e-16 relative; moments near zero carry the second step's
    # gradient's rounding, hence the absolute term)
    np.testing.assert_allclose(p1, p0, rtol=1e-12, atol=1e-15)
    for k in s0:
        np.testing.assert_allclose(s1[k], s0[k], rtol=1e-12, atol=1e-15)


def test_an_offloaded_checkpoint_resumes_on_the_device(world, text, on_device, offloaded_zero_3):
    """Saved after step 1 offloaded at zero 3, resumed at zero 0 without offload, and at zero 1 with
    offload (its host masters taken from the loaded parameters): step 2 gives the uninterrupted
    run's bits (the file holds the host state, logical as ever)."""
    p0, s0 = on_device
    folder = offloaded_zero_3[1]
    for zero, offload in ((0, "none"), (1, "optimizer")):
        _, start, p, s = _run(text, world, zero, offload, steps=2, resume=os.path.join(folder, "ckpt-00000001.h5"))
        assert start == 1
        assert np.array_equal(p, p0) and all(np.array_equal(s[k], s0[k]) for k in s0), (zero, offload)

"""The GPT on the CUDA device inside an MPI job of 2 ranks: token upload, forward, backward,
the gradients' way out through the host-staging path (pinned buffers; chosen on the
simulator, whose arrays MPI would otherwise take directly) and AdamW, with and without
ZeRO-3 (which runs ZeRO-2's gradient slots and gathers the parameters), equal the same job on the CPU (float64; tolerance as tests/test_gpt_cuda_step.py). Runs under mpirun -n 2
only: on the simulator each run takes seconds, and 2 ranks is the case the staging path has to
get right.

The text is folded into 16 tokens (conftest's ``mpi_small_vocab_text``).
"""

import numpy as np
import pytest

from hpctrain.device import cuda_status
from steps import train_losses, train_step

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600),
              pytest.mark.skipif(cuda_status()[0] == 0, reason="numba.cuda unusable")]


@pytest.fixture(scope="module")
def text(request):
    from mpi4py import MPI

    if MPI.COMM_WORLD.size != 2:
        pytest.skip("runs under mpirun -n 2 only (see the module docstring)")
    return request.getfixturevalue("mpi_small_vocab_text")


def _reused(slot_of) -> bool:
    """Whether two buckets of a slot pool take the same slot (``slot_of``: each bucket's slot)."""
    return len(set(slot_of)) < len(slot_of)


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_gpt_on_cuda_trains_like_cpu_across_ranks(text, zero):
    """zero 2: the parameters all-gathered after each bucket's update, and the gradient slots; zero 3:
    ZeRO-2's gradient slots and this rank's chunks on the device, the chunks copied and
    added (two micro-batches) on the communication thread while backward writes the next slots; and
    the parameters' chunks on the device, each layer part's bucket gathered into reused device slots
    through pinned buffers on the gather thread before it runs (slots reused: checked), two steps so
    that the second fetches ahead in the first one's recorded order. The gathers are fenced: the
    gather thread waits for its slot's event, never for the device's whole stream (checked)."""
    import threading

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer
    from test_gpt_cuda_step import _config, assert_close

    world = init_world()
    runs = {}
    for device in ("cpu", "cuda"):
        cfg = _config(text, device, steps=1 if zero == 2 else 2)
        cfg.train.global_batch = world.size   # one window a micro-batch on each rank
        if zero:  # two micro-batches
            cfg.dist.zero, cfg.dist.allreduce, cfg.train.grad_accum_steps = zero, "ring", 2
            cfg.train.global_batch *= 2
            cfg.dist.bucket_mb = cfg.dist.first_bucket_mb = 0.001  # zero 2: 131 values, slots reused (checked);
            # zero 3 takes its layer buckets
            # blocks enough for both pools to reuse their slots (checked): zero 2's gradient slots need
            # two (a block's buckets are in use together), zero 3's layer buckets take turns within one
            cfg.model.n_layer = 2 if zero == 2 else 1
        trainer = Trainer(cfg, world, Log(False))
        if device == "cuda":
            assert trainer.plan.staging.mode == "pinned"
        if zero:
            assert trainer.plan.grad_slots.rotating < len(trainer.plan.buckets) - 1
            assert _reused(trainer.plan.grad_slots.slot_of)
        if zero == 3:
            assert trainer.plan.param_slots.layout.rotating < len(trainer.plan.buckets) - 1
            assert _reused(trainer.plan.param_slots.layout.slot_of)
        waits = []   # the threads that waited for the device's whole stream
        if device == "cuda":
            whole = trainer.device.stream.synchronize
            trainer.device.stream.synchronize = lambda: waits.append(threading.current_thread().name) or whole()
        losses = train_losses(trainer, cfg.train.steps)
        slots = trainer.plan.param_slots
        if device == "cuda" and zero == 3:
            assert slots._fence is not None and all(e is not None for e in slots._slot_events)
            assert "hpctrain-zero3-gather" not in waits and "MainThread" in waits, set(waits)
        runs[device] = losses, (trainer.device.to_host(trainer.model.flat.data).copy() if slots is None
                                else slots.whole(trainer.plan.dp.comm))
        trainer.close()
    (l_cpu, p_cpu), (l_gpu, p_gpu) = runs["cpu"], runs["cuda"]
    for (a, ca), (b, cb) in zip(l_cpu, l_gpu):
        np.testing.assert_allclose(b, a, rtol=1e-12)
        assert ca == cb
    assert_close(p_gpu, p_cpu)
    # data parallelism kept every rank's parameters identical
    gathered = world.comm.allgather(p_gpu)
    for other in gathered[1:]:
        np.testing.assert_array_equal(other, gathered[0])


def test_tensor_parallel_gpt_on_cuda_trains_like_cpu(text):
    """dist.tensor_parallel = 2 on the device: the row-split projections' partial outputs and the
    column-split layers' input gradients go through the tensor group's all-reduce (host staging),
    and one step gives the CPU's loss and logical parameters (the CPU's split run equals t = 1:
    tests/test_mpi_tensor_parallel.py)."""
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer
    from test_gpt_cuda_step import _config, assert_close

    world = init_world()
    runs = {}
    for device in ("cpu", "cuda"):
        cfg = _config(text, device, steps=1)
        cfg.dist.tensor_parallel, cfg.train.global_batch = 2, 1
        trainer = Trainer(cfg.validate(), world, Log(False))
        step = train_step(trainer)
        loss = step.loss_sum, step.correct
        model = trainer.model
        host = trainer.device.to_host(model.flat.data)
        params = np.concatenate([model.tensor_layout.logical(s.name, host[s.offset:s.offset + s.size].reshape(s.shape))
                                 .reshape(-1) for s in model.flat.slots])
        runs[device] = loss, params, step.tensor["tensor_allreduces"]
        trainer.close()
    (l_cpu, p_cpu, n_cpu), (l_gpu, p_gpu, n_gpu) = runs["cpu"], runs["cuda"]
    np.testing.assert_allclose(l_gpu[0], l_cpu[0], rtol=1e-12)
    assert l_gpu[1] == l_cpu[1] and n_gpu == n_cpu == 4 * cfg.model.n_layer
    assert_close(p_gpu, p_cpu)


def test_pipeline_gpt_on_cuda_trains_like_cpu(text):
    """dist.pipeline_parallel = 2 on the device: the residual stream and its gradient cross between
    the stages through pinned host buffers (non-blocking sends, blocking receives), the first stage
    clears its tied-table gradient on the device, the table's two gradients are summed over the
    embedding group; one step of two micro-batches gives the CPU's loss and parameters (the CPU's
    pipeline equals p = 1: tests/test_mpi_pipeline.py)."""
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer
    from test_gpt_cuda_step import _config, assert_close

    world = init_world()
    runs = {}
    for device in ("cpu", "cuda"):
        cfg = _config(text, device, steps=1)
        cfg.model.n_layer, cfg.dist.pipeline_parallel, cfg.train.grad_accum_steps = 2, 2, 2
        cfg.train.global_batch = 2   # one window a micro-batch
        trainer = Trainer(cfg.validate(), world, Log(False))
        if device == "cuda":
            assert trainer.stepper.runner.stage.staging.mode == "pinned"
        step = train_step(trainer)
        loss = step.loss_sum, step.correct
        host = trainer.device.to_host(trainer.model.flat.data).copy()
        runs[device] = loss[0], host
        trainer.close()
    (l_cpu, p_cpu), (l_gpu, p_gpu) = runs["cpu"], runs["cuda"]
    np.testing.assert_allclose(l_gpu, l_cpu, rtol=1e-12)
    assert l_cpu > 0
    assert_close(p_gpu, p_cpu)

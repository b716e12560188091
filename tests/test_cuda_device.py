"""The cuda device: choosing it, moving data, MPI staging, and a whole training
step on it against the same step on the CPU (numba's simulator without a GPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hpctrain import device as device_mod
from hpctrain.training.config import Config
from hpctrain.device import CpuDevice, CudaDevice, gpu_for_rank, make_device
from hpctrain.comm.staging import Staging, cuda_aware_mpi, staging_mode
from hpctrain.errors import ConfigError
from steps import train_losses

needs_cuda = pytest.mark.skipif(device_mod.cuda_status()[0] == 0, reason="numba.cuda unusable")


# ---- choosing a device ---------------------------------------------------------------
@pytest.mark.parametrize("local_rank, n_gpus, expected", [(0, 1, 0), (3, 1, 0), (5, 4, 1), (7, 8, 7), (8, 8, 0)])
def test_gpu_is_local_rank_modulo_visible_gpus(local_rank, n_gpus, expected):
    assert gpu_for_rank(local_rank, n_gpus) == expected


def test_auto_is_cpu_without_gpu(monkeypatch):
    monkeypatch.setattr(device_mod.choose, "simulated", lambda: False)
    monkeypatch.setattr(device_mod.choose, "cuda_status", lambda: (0, "no driver"))
    assert isinstance(make_device("auto", "float32"), CpuDevice)


def test_no_loadable_driver_library_means_no_gpu_before_numba_cuda_is_asked(monkeypatch):
    import ctypes

    tried = []

    def no_library(name, *args, **kwargs):
        tried.append(name)
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(device_mod.choose, "simulated", lambda: False)
    monkeypatch.delenv("NUMBA_CUDA_DRIVER", raising=False)
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert device_mod.cuda_status() == (0, "no CUDA driver library (libcuda.so.1) can be loaded")
    assert {"libcuda.so.1", "/usr/lib/libcuda.so", "/usr/lib64/libcuda.so.1"} <= set(tried)  # where numba looks
    monkeypatch.setenv("NUMBA_CUDA_DRIVER", "/opt/elsewhere/libcuda.so")  # numba decides then
    assert device_mod.cuda_status() != (0, "no CUDA driver library (libcuda.so.1) can be loaded")


@needs_cuda
def test_auto_never_picks_the_simulator():
    if not device_mod.simulated():
        pytest.skip("a real GPU is visible: auto picks it (covered by the gpu tests)")
    assert isinstance(make_device("auto", "float32"), CpuDevice)


def test_cuda_without_gpu_is_a_config_error_naming_the_fix(monkeypatch):
    monkeypatch.setattr(device_mod.choose, "cuda_status", lambda: (0, "numba.cuda finds no usable GPU or driver"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=r"train.device='cuda' but no GPU.*CUDA_VISIBLE_DEVICES=''.*'auto' or 'cpu'"):
        make_device("cuda", "float32")


def test_unknown_device_is_a_config_error():
    with pytest.raises(ConfigError, match="auto, cpu or cuda"):
        make_device("tpu", "float32")


@needs_cuda
def test_cuda_device_is_chosen_by_name_and_describes_itself():
    dev = make_device("cuda", "float64")
    assert isinstance(dev, CudaDevice) and dev.dtype == np.float64
    # auto GEMM: cuBLAS where CuPy runs, never on the simulator
    assert dev.describe().startswith("cuda:0 (") and dev.describe().endswith(
        f"float64, GEMM {dev.gemm}, attention {dev.attention})")
    assert dev.gemm == "numba" if device_mod.simulated() else dev.gemm in ("numba", "cublas")


@needs_cuda
def test_gemm_choice_is_checked():
    with pytest.raises(ConfigError, match="auto, numba or cublas"):
        make_device("cuda", "float32", gemm="mkl")
    if device_mod.simulated():
        with pytest.raises(ConfigError, match="train.gemm='cublas' needs CuPy"):
            make_device("cuda", "float32", gemm="cublas")


# ---- moving data -----------------------------------------------------------------------
@needs_cuda
def test_upload_reuses_one_buffer_per_slot_and_shape():
    dev = CudaDevice("float32")
    a = dev.upload(np.arange(6.0).reshape(2, 3), "x")
    b = dev.upload(np.ones((2, 3)), "x")
    assert a is b and b.dtype == np.float32
    np.testing.assert_array_equal(dev.to_host(b), np.ones((2, 3)))
    assert dev.upload(np.ones((4, 3)), "x") is not a          # another shape: its own buffer
    labels = dev.upload(np.array([1, 2]), "y", np.int64)
    assert labels.dtype == np.int64


# ---- MPI staging -----------------------------------------------------------------------
def test_cpu_buffers_go_to_mpi_directly():
    assert staging_mode(CpuDevice()) == "host"
    buf = np.zeros(3)
    with Staging(CpuDevice()).mpi_view(buf) as view:
        assert view is buf


def test_debian_open_mpi_is_detected_as_not_cuda_aware():
    # the question is asked of the library itself; Debian's Open MPI 4.1.4 says no
    aware, how = cuda_aware_mpi()
    assert isinstance(aware, bool) and how
    from mpi4py import MPI

    if "Debian OpenMPI" in MPI.Get_library_version():
        assert (aware, how) == (False, "MPIX_Query_cuda_support()")


@needs_cuda
@pytest.mark.parametrize("setting, mode", [("on", "device"), ("off", "pinned")])
def test_staging_setting_overrides_detection(setting, mode):
    assert staging_mode(CudaDevice(), setting) == mode


@needs_cuda
def test_pinned_staging_copies_through_one_reused_host_buffer():
    dev = CudaDevice("float64")
    staging = Staging(dev, "off")
    buf = dev.from_host(np.arange(5.0))
    with staging.mpi_view(buf) as host:
        assert type(host) is np.ndarray          # plain host memory, not the device array
        np.testing.assert_array_equal(host, np.arange(5.0))
        host *= 10                               # what an MPI receive would do
    np.testing.assert_array_equal(dev.to_host(buf), 10 * np.arange(5.0))
    with staging.mpi_view(dev.from_host(np.ones(5))) as again:
        assert again is host                     # allocated once, reused
    with staging.mpi_view(dev.zeros(5), slot="bucket1") as other:
        assert other is not host                 # buffers in flight together get their own


@needs_cuda
def test_pinned_staging_leaves_the_device_buffer_alone_when_mpi_fails():
    dev = CudaDevice("float64")
    staging = Staging(dev, "off")
    buf = dev.from_host(np.arange(3.0))
    with pytest.raises(RuntimeError):
        with staging.mpi_view(buf) as host:
            host[:] = -1
            raise RuntimeError("MPI error")
    np.testing.assert_array_equal(dev.to_host(buf), np.arange(3.0))


@needs_cuda
def test_fenced_staging_in_a_thread_reads_the_fenced_writes_and_the_stream_sees_the_copy_back():
    """The communication thread's path (hpctrain/device/transfers.py) on real streams: a buffer written
    before the fence's event is copied out inside fenced(event) on the thread's stream, changed on
    the host (as an MPI receive would) and copied back; a kernel the device's stream runs next sees
    the change. On a GPU, with 100 passes over 1 GiB queued behind the event, the thread's copies
    also finish before that work does: it did not wait for the whole stream."""
    import threading

    from hpctrain.device import simulated

    dev = CudaDevice("float32")
    staging = Staging(dev, "off")
    a = dev.from_host(np.ones(1 << 16, np.float32))
    dev.ops.scale(a, 3.0)                                     # written before the event
    ready = dev.fence.record(dev.fence.new_event())
    later = dev.zeros(1 if simulated() else 1 << 28)           # 1 GiB of later work on a GPU
    for _ in range(1 if simulated() else 100):   # ~45 ms on an H100
        dev.ops.scale(later, 1.0)
    behind = dev.fence.record(dev.fence.new_event())
    seen = []

    def communication_thread():
        with dev.thread_context(), dev.fence.fenced(ready):
            with staging.mpi_view(a, slot="fenced") as host:
                seen.append(bool(np.all(host == 3.0)))
                host += 1.0
            seen.append(simulated() or not behind.query())   # later work still running: not waited for
    thread = threading.Thread(target=communication_thread)
    thread.start()
    thread.join(60)
    dev.ops.scale(a, 2.0)                                     # on the device's stream, after the copy back
    np.testing.assert_array_equal(dev.to_host(a), 8.0)
    assert seen == [True, True]


def test_a_launch_geometry_is_configured_once_per_thread(monkeypatch):
    """kernels/support/cuda_support.configured: numba's kernel[grid, block, stream] is made once per thread,
    kernel, geometry and stream, then reused (a stand-in kernel counts the configurations; the
    simulator's own configure rewrites the kernel, so there it is made every time)."""
    import threading

    from hpctrain.kernels.support import cuda_support

    made = []

    class Kernel:
        def __getitem__(self, config):
            made.append(config)
            return ("configured", config, threading.get_ident())
    monkeypatch.setattr(cuda_support, "simulated", lambda: False)
    k, other = Kernel(), Kernel()
    first = cuda_support.configured(k, 4, 256, 0)
    assert cuda_support.configured(k, 4, 256, 0) is first and len(made) == 1
    cuda_support.configured(k, 8, 256, 0)        # another grid
    cuda_support.configured(other, 4, 256, 0)    # another kernel
    cuda_support.configured(k, 4, 256, 7)        # another stream (by its handle)
    assert len(made) == 4
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(cuda_support.configured(k, 4, 256, 0)))
    thread.start()
    thread.join(10)
    assert len(made) == 5 and elsewhere[0] is not first   # a thread of its own gets its own
    monkeypatch.setattr(cuda_support, "simulated", lambda: True)
    cuda_support.configured(k, 4, 256, 0)
    assert len(made) == 6


# ---- a training step -------------------------------------------------------------------
def _config(train_path, device):
    cfg = Config()
    cfg.data.train, cfg.data.eval = train_path, ""
    cfg.model.hidden, cfg.model.activation = [16, 12], "gelu"
    cfg.train.global_batch, cfg.train.dtype, cfg.train.device = 12, "float64", device
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay = "adamw", 0.01, 0, 0.01
    return cfg.validate()


@needs_cuda
@pytest.mark.timeout(600)
def test_trainer_steps_on_cuda_equal_cpu_steps(small_data):
    """Data upload, forward, backward, all-reduce (1 rank, staged), AdamW: float64 twins agree."""
    from mpi4py import MPI

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    world = init_world(MPI.COMM_SELF)
    runs = {}
    for device in ("cpu", "cuda"):
        trainer = Trainer(_config(small_data[0], device), world, Log(False))
        initial = trainer.device.to_host(trainer.model.flat.data).copy()
        losses = train_losses(trainer, 2)
        runs[device] = losses, trainer.device.to_host(trainer.model.flat.data).copy(), \
            trainer.device.to_host(trainer.optimizer.exp_avg_sq).copy()
        if device == "cuda" and device_mod.simulated():
            assert trainer.plan.staging.mode == "pinned"   # the real staging path, not the simulator's shortcut
    (l_cpu, p_cpu, v_cpu), (l_gpu, p_gpu, v_gpu) = runs["cpu"], runs["cuda"]
    for (a, ca), (b, cb) in zip(l_cpu, l_gpu):
        np.testing.assert_allclose(b, a, rtol=1e-12)
        assert ca == cb
    np.testing.assert_allclose(p_gpu, p_cpu, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(v_gpu, v_cpu, rtol=1e-11, atol=1e-20)
    assert np.abs(p_cpu - initial).max() > 1e-4   # the two steps did move the parameters


def test_simulator_shared_arrays_are_one_array_per_call_site_for_every_thread():
    """numba's simulator creates a block's shared array on first use without a lock, so two
    threads could each get their own (a GEMM then read cells nobody wrote, now and then);
    after CudaDevice, 64 threads released at once get one array per line, and a GEMM with
    ragged tiles gives the same bits on every repetition, with the GIL switching often."""
    import sys
    import threading

    from numba import cuda

    from hpctrain.device import simulated
    from hpctrain.kernels.linear import gemm_cuda

    if not simulated():
        pytest.skip("a simulator property")
    CudaDevice("float64")
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    shared, start, got = FakeCUDAShared(0), threading.Barrier(64), []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def grab():
            start.wait()
            a = shared.array(16, np.float64)
            b = shared.array(16, np.float64)
            got.append((id(a), id(b)))
        threads = [threading.Thread(target=grab) for _ in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(got)) == 1 and got[0][0] != got[0][1]
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((1, 16)), rng.standard_normal((16, 16))
        da, db = cuda.to_device(a), cuda.to_device(b)
        outs = {gemm_cuda(da, db, cuda.device_array((1, 16))).copy_to_host().tobytes() for _ in range(8)}
    finally:
        sys.setswitchinterval(interval)
    assert len(outs) == 1
    np.testing.assert_allclose(np.frombuffer(outs.pop()).reshape(1, 16), a @ b, rtol=1e-13)


# ---- the op table ----------------------------------------------------------------------
# ops that run no model compute (shapes and limits, the gradient's scale and finite test on the
# communication side, its norm for clipping in the optimizer phase, the precision conversions, which
# a 16-bit model's ops run inside their own times): train.op_times leaves them out of its families
UNTIMED = {"attention_state_shapes", "attention_max_head_size", "attention_saved_kind", "scale", "all_finite",
           "sum_squares", "sum_squares_each", "narrow", "widen",   # these two: train.precision's conversions
           "fill"}   # a pipeline's first stage clears its tied-table gradient


@needs_cuda
def test_both_devices_offer_the_same_ops_and_op_times_files_each_compute_op_in_a_family():
    """A new op (a fused one, say) must land in both tables and in a train.op_times family, or its
    time would vanish from the per-op split."""
    from hpctrain.observe.op_times import family_of

    cpu, cuda = set(vars(CpuDevice("float64").ops)), set(vars(CudaDevice("float64").ops))
    assert cpu == cuda, (cpu ^ cuda)
    assert {op for op in cpu if family_of(op) is None} == UNTIMED


def test_a_cuda_device_patches_nothing_and_imports_no_test_tool():
    """The simulator's fixes for concurrent launches are an opt-in test tool (hpctrain.testing):
    a CudaDevice made on the simulator, and a step of kernels on it, leave numba's simulator as it
    is, and nothing of hpctrain's imports the tool."""
    import subprocess
    import sys

    from conftest import REPO

    code = ("import sys\n"
            "import numpy as np\n"
            "import hpctrain.__main__, hpctrain.training.trainer\n"
            "from hpctrain.device import CudaDevice\n"
            "dev = CudaDevice('float32')\n"
            "x = dev.from_host(np.ones(300, np.float32))\n"
            "dev.ops.scale(x, 2.0)\n"
            "assert dev.to_host(x).sum() == 600\n"
            "from numba.cuda.simulator import kernel\n"
            "assert not hasattr(kernel.FakeCUDAKernel, '_hpctrain_serialized'), 'the simulator was patched'\n"
            "assert not hasattr(kernel.BlockManager, '_hpctrain_barrier'), 'the simulator was patched'\n"
            "assert 'hpctrain.testing' not in sys.modules, 'production code imported hpctrain.testing'\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]

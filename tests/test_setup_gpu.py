"""A GPU machine gets cuBLAS from the two commands: set-up's CuPy choice, ``info``'s GEMM column,
and the start-up warning when ``train.gemm = auto`` falls back to the numba GEMMs.

The set-up logic runs as scripts/setup.sh runs it (scripts/cupy-wheel.sh, which setup.sh sources)
with a stand-in ``nvidia-smi`` on a PATH of its own: no GPU, no network, nothing installed.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types

import pytest

from conftest import REPO

BASH = shutil.which("bash")

# what nvidia-smi prints on an H100 (driver 570 reports CUDA 12.8, driver 580 CUDA 13.0)
LISTING = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f3a2b1c-8d9e-4f70-a1b2-c3d4e5f60718)\n"
BANNER = """\
Thu Nov 27 15:48:02 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver}             Driver Version: {driver}     CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|=========================================+========================+======================|
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0 Off |                    0 |
| N/A   31C    P0             70W /  700W |       1MiB /  81559MiB |      0%      Default |
+-----------------------------------------+------------------------+----------------------+
"""
QUERY = """\

==============NVSMI LOG==============

Timestamp                                 : Thu Nov 27 15:48:02 2026
Driver Version                            : {driver}
CUDA Version                              : {cuda}

Attached GPUs                             : 1
"""
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n")


def _stand_in(bin_dir, listing: str, banner: str, query: str, rc: int = 0) -> None:
    """An executable ``nvidia-smi`` in ``bin_dir`` answering -L, -q and the plain call."""
    for name, text in (("listing", listing), ("banner", banner), ("query", query)):
        (bin_dir / f"nvidia-smi.{name}").write_text(text)
    script = bin_dir / "nvidia-smi"
    script.write_text(textwrap.dedent(f"""\
        #!{BASH}
        here=$(dirname "$0")
        case "${{1:-}}" in
            -L) cat "$here/nvidia-smi.listing" ;;
            -q) cat "$here/nvidia-smi.query" ;;
            *) cat "$here/nvidia-smi.banner" ;;
        esac
        exit {rc}
        """))
    script.chmod(0o755)


def _h100(bin_dir, cuda: str, driver: str = "570.86.15", banner_has_version: bool = True) -> None:
    banner = BANNER.format(driver=driver, cuda=cuda)
    if not banner_has_version:
        banner = banner.replace(f"CUDA Version: {cuda}", "")
    _stand_in(bin_dir, LISTING, banner, QUERY.format(driver=driver, cuda=cuda))


@pytest.fixture
def path(tmp_path):
    """A PATH with the tools scripts/cupy-wheel.sh uses and no nvidia-smi (a real one would
    otherwise answer on a GPU machine); stand-ins go in its first folder."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("sed", "grep", "dirname", "cat", "sha256sum", "cut"):  # cupy-wheel.sh's, the fingerprint's
        os.symlink(shutil.which(tool), tools / tool)
    stand_ins = tmp_path / "stand-ins"
    stand_ins.mkdir()
    return stand_ins, f"{stand_ins}{os.pathsep}{tools}"


def choose(path_var: str, **env) -> tuple[str, str]:
    """(the wheel scripts/cupy-wheel.sh chooses, its one line of why) under ``path_var``."""
    proc = subprocess.run([BASH, "scripts/cupy-wheel.sh"], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={"PATH": path_var, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr.strip()


# ---- set-up's choice ------------------------------------------------------------------
def test_h100_with_cuda_12_8_gets_cupy_cuda12x(path):
    stand_ins, path_var = path
    _h100(stand_ins, "12.8")
    wheel, why = choose(path_var)
    assert wheel == "cupy-cuda12x", why
    assert "CUDA 12.8" in why and "pip install 'cupy-cuda12x[ctk]>=14'" in why


def test_h100_with_cuda_13_0_gets_the_cuda_12_wheel(path):
    """A CUDA 13 driver runs CUDA 12 code; cupy-cuda13x's CUDA 13 libraries would be found before
    numba-cuda[cu12]'s nvrtc (setup.cfg's gpu extra says why)."""
    stand_ins, path_var = path
    _h100(stand_ins, "13.0", driver="580.159.04")
    wheel, why = choose(path_var)
    assert wheel == "cupy-cuda12x", why
    assert "CUDA 13.0" in why


def test_cuda_version_read_from_the_query_when_the_banner_lacks_it(path):
    stand_ins, path_var = path
    _h100(stand_ins, "12.4", banner_has_version=False)
    assert choose(path_var)[0] == "cupy-cuda12x"


def test_a_driver_without_a_known_wheel_is_said_and_skipped(path):
    stand_ins, path_var = path
    _h100(stand_ins, "11.4", driver="470.256.02")
    wheel, why = choose(path_var)
    assert wheel == "" and "CUDA 11.4" in why and "no CuPy" in why


def test_nvidia_smi_that_lists_no_gpu_gets_no_cupy(path):
    stand_ins, path_var = path
    _stand_in(stand_ins, NO_DRIVER, NO_DRIVER, NO_DRIVER, rc=9)
    wheel, why = choose(path_var)
    assert wheel == "" and "lists no GPU" in why and "couldn't communicate with the NVIDIA driver" in why


def test_no_nvidia_smi_gets_no_cupy(path):
    _, path_var = path
    wheel, why = choose(path_var)
    assert wheel == "" and "no nvidia-smi" in why


@pytest.mark.parametrize("asked, wheel", [("none", ""), ("cupy-cuda12x", "cupy-cuda12x"), ("cupy-cuda99x", "")])
def test_hpctrain_cupy_overrides_the_detection(path, asked, wheel):
    stand_ins, path_var = path
    _h100(stand_ins, "12.8")
    got, why = choose(path_var, HPCTRAIN_CUPY=asked)
    assert got == wheel and f"HPCTRAIN_CUPY={asked}" in why


def test_the_requirement_is_setup_cfg_gpu_extra(path):
    """setup.sh pip-installs CUPY_REQUIREMENT: setup.cfg's gpu extra line, versions and [ctk] included."""
    stand_ins, path_var = path
    _h100(stand_ins, "12.8")
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    gpu = [line for line in cfg["options.extras_require"]["gpu"].splitlines() if line.strip()]
    assert gpu == ["cupy-cuda12x[ctk]>=14"]  # [ctk], cuBLAS from pip, came with CuPy 14
    assert f"(pip install '{gpu[0]}')" in choose(path_var)[1]
    from hpctrain.kernels.support.cublas import CUPY_FIX

    assert f"pip install '{gpu[0]}'" in CUPY_FIX  # the fix every message names installs the same


def _fingerprint(path_var: str) -> str:
    """setup.sh's own fingerprint function, after its own cupy_wheel call, under ``path_var``."""
    script = textwrap.dedent("""\
        set -euo pipefail
        PYTHON=python3 HDF5_DIR_ASKED=""
        . scripts/cupy-wheel.sh
        cupy_wheel
        eval "$(sed -n '/^fingerprint() {$/,/^}$/p' scripts/setup.sh)"
        fingerprint
        """)
    proc = subprocess.run([BASH, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={"PATH": path_var})
    assert proc.returncode == 0 and re.fullmatch(r"[0-9a-f]{64}\n", proc.stdout), proc.stderr
    return proc.stdout


def test_setup_sh_uses_the_choice_and_reruns_when_a_gpu_appears(path):
    """setup.sh sources scripts/cupy-wheel.sh before its stamp check, installs its requirement, and its
    fingerprint changes when nvidia-smi starts listing a GPU (so the slow part runs again)."""
    setup = open(os.path.join(REPO, "scripts", "setup.sh")).read()
    source, stamp_check = setup.find("\n. scripts/cupy-wheel.sh\ncupy_wheel"), setup.find('[ -f "$STAMP" ]')
    assert 0 < source < stamp_check, "setup.sh must source scripts/cupy-wheel.sh and call cupy_wheel first"
    assert 'install "$CUPY_REQUIREMENT"' in setup
    stand_ins, path_var = path
    without = _fingerprint(path_var)
    _h100(stand_ins, "12.8")
    assert _fingerprint(path_var) != without


# ---- the start-up warning -----------------------------------------------------------------
@pytest.mark.parametrize("choice, cupy_ok, simulated, warns", [
    ("auto", False, False, True),     # CuPy missing on a GPU: the one case
    ("auto", True, False, False),     # cuBLAS runs
    ("numba", False, False, False),   # chosen on purpose
    ("auto", False, True, False),     # the simulator: CuPy can never run there
    ("cublas", False, False, False),  # a ConfigError elsewhere, not a warning
])
def test_gemm_fallback_warning_only_when_auto_lost_cublas_on_a_gpu(choice, cupy_ok, simulated, warns):
    from hpctrain.device import gemm_fallback_warning

    note = gemm_fallback_warning(choice, cupy_ok, simulated, why="CuPy is not installed", gpu=3)
    if not warns:
        assert note is None
        return
    assert "CuPy is not installed" in note and "GPU 3" in note and "numba GEMM" in note
    assert "bash scripts/setup.sh" in note and "pip install 'cupy-cuda12x[ctk]>=14'" in note
    assert "train.gemm = numba" in note  # how to silence it on purpose


def test_cuda_device_carries_the_note(monkeypatch):
    """The device made for train.gemm = auto on a GPU without CuPy (CuPy's check answers so) holds
    the note the trainer logs; on the simulator, with gemm = numba, and on the cpu it holds none."""
    from hpctrain import device as device_mod
    from hpctrain.kernels.support import cublas

    if device_mod.cuda_status()[0] == 0:
        pytest.skip("numba.cuda unusable")
    assert device_mod.CpuDevice("float32").gemm_note is None
    if device_mod.simulated():
        assert device_mod.CudaDevice("float32", gemm="auto").gemm_note is None
        monkeypatch.setattr(device_mod.cuda, "simulated", lambda: False)  # from here as on a GPU
    monkeypatch.setattr(cublas, "cupy_status", lambda gpu=0: (False, "CuPy is not installed"))
    dev = device_mod.CudaDevice("float32", gemm="auto")
    assert dev.gemm == "numba" and "CuPy is not installed" in dev.gemm_note
    assert device_mod.CudaDevice("float32", gemm="numba").gemm_note is None
    assert dev.with_gemm("numba").gemm_note is None


# ---- info's GEMM column -------------------------------------------------------------------
def _fake_cupy(version="14.2.0", built=12090, driver=13000):
    runtime = types.SimpleNamespace(runtimeGetVersion=lambda: built, driverGetVersion=lambda: driver)
    return types.SimpleNamespace(__version__=version, cuda=types.SimpleNamespace(runtime=runtime))


def test_cupy_found_names_why_not_without_a_context(monkeypatch):
    from hpctrain.kernels.support.cublas import cupy_found

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ModuleNotFoundError
    assert cupy_found() == ("", "CuPy is not installed")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    assert cupy_found() == ("14.2.0", "")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(built=13000, driver=12080))
    assert cupy_found() == ("", "CuPy 14.2.0 is built for CUDA 13, the driver runs CUDA 12.8")


@pytest.mark.parametrize("gpus, sim, cupy, gemm", [
    (0, False, ("", ""), "numpy BLAS"),
    (1, True, ("", ""), "numba (simulator)"),
    (2, False, ("14.2.0", ""), "cublas (CuPy 14.2.0)"),
    (2, False, ("", "CuPy is not installed"), "numba (CuPy is not installed)"),
])
def test_info_names_each_ranks_gemm(monkeypatch, gpus, sim, cupy, gemm):
    from hpctrain import device as device_mod
    from hpctrain.kernels.support import cublas
    from hpctrain.observe import info

    monkeypatch.setattr(device_mod, "cuda_status", lambda: (gpus, "" if gpus else "no driver"))
    monkeypatch.setattr(device_mod, "simulated", lambda: sim)
    monkeypatch.setattr(device_mod, "gpu_name", lambda gpu: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cublas, "cupy_found", lambda: cupy)
    device, got, _ = info._device_choice(local_rank=3)
    assert gemm in got
    if gpus and not sim:
        assert device == "cuda:1 NVIDIA H100 80GB HBM3"  # local rank 3 of 2 GPUs


def test_info_prints_the_gemm_column_and_the_fix_once(monkeypatch, capsys):
    from mpi4py import MPI

    from hpctrain import device as device_mod
    from hpctrain.kernels.support import cublas
    from hpctrain.observe import info
    from hpctrain.runtime import init_world

    monkeypatch.setattr(device_mod, "cuda_status", lambda: (1, ""))
    monkeypatch.setattr(device_mod, "simulated", lambda: False)
    monkeypatch.setattr(device_mod, "gpu_name", lambda gpu: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cublas, "cupy_found", lambda: ("", "CuPy is not installed"))
    info.print_info(init_world(MPI.COMM_SELF))
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["rank", "host"])
    assert header.split()[5:8] == ["device", "GEMM", "CUDA"]
    assert "numba (CuPy is not installed)" in out
    fixes = [line for line in out.splitlines() if "bash scripts/setup.sh" in line]
    assert len(fixes) == 1 and "rank(s) 0" in fixes[0]



@pytest.mark.timeout(300)
def test_trainer_logs_the_device_note_once_on_rank_0(monkeypatch, small_data, tmp_path):
    """Start-up logs the device's gemm_note as one warning (the decision itself is tested above)."""
    import io

    from mpi4py import MPI

    from hpctrain import device as device_mod
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.config import Config
    from hpctrain.training.trainer import Trainer

    if device_mod.cuda_status()[0] == 0:
        pytest.skip("numba.cuda unusable")
    monkeypatch.setattr(device_mod.cuda, "gemm_fallback_warning",
                        lambda choice, *args, **kw: "NOTE" if choice == "auto" else None)
    world = init_world(MPI.COMM_SELF)
    for device, warnings in (("cuda", 1), ("cpu", 0)):
        cfg = Config()
        cfg.data.train, cfg.data.eval, cfg.model.hidden = small_data[0], "", [8]
        cfg.train.global_batch, cfg.train.device, cfg.train.gemm = 8, device, "auto"
        cfg.checkpoint.dir = str(tmp_path / "ckpt")
        out = io.StringIO()
        Trainer(cfg.validate(), world, Log(True, out)).close()
        assert out.getvalue().count("hpctrain: warning: NOTE") == warnings, out.getvalue()

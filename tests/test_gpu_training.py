"""Real-GPU runs (marked gpu: skipped with the reason printed when no GPU is
usable; scripts/test.sh runs them with NUMBA_ENABLE_CUDASIM=0 when nvidia-smi
lists a GPU). Two ranks share GPU 0, and their training equals a one-rank CPU
run with the same global batch, step by step.
"""

import json
import re

import pytest

from conftest import run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

GPU_ENV = {"NUMBA_ENABLE_CUDASIM": "0", "CUDA_VISIBLE_DEVICES": "0"}


def _losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_two_ranks_sharing_one_gpu_train_like_one_cpu_rank(small_data, tmp_path):
    train, eval_ = small_data
    common = ["-m", "hpctrain", "train", "--set", f"data.train={train}", "--set", f"data.eval={eval_}",
              "--set", "model.hidden=[64, 64]", "--set", "model.activation=gelu",
              "--set", "train.dtype=float64", "--set", "train.steps=40", "--set", "train.global_batch=64",
              "--set", "optim.name=adamw", "--set", "optim.lr=0.003", "--set", "optim.warmup_steps=5"]
    gpu = run_mpi(2, common + ["--set", "train.device=cuda", "--set", f"train.metrics={tmp_path}/gpu.jsonl"],
                  timeout=500, env_extra=GPU_ENV)
    assert gpu.returncode == 0, gpu.stdout[-2000:] + gpu.stderr[-2000:]
    assert re.search(r"device cuda:0 \(", gpu.stdout), gpu.stdout[-1000:]
    cpu = run_mpi(1, common + ["--set", "train.device=cpu", "--set", f"train.metrics={tmp_path}/cpu.jsonl"],
                  timeout=300)
    assert cpu.returncode == 0, cpu.stderr[-2000:]
    # float64: only the summation order differs (within a rank, then across ranks)
    assert _losses(tmp_path / "gpu.jsonl") == pytest.approx(_losses(tmp_path / "cpu.jsonl"), rel=1e-9)
    acc = [float(re.search(r"final eval accuracy ([\d.]+)%", p.stdout).group(1)) for p in (gpu, cpu)]
    assert acc[0] == pytest.approx(acc[1], abs=0.2)  # at most one of 512 eval rows differs


def test_info_shows_each_rank_on_the_shared_gpu():
    proc = run_mpi(2, ["-m", "hpctrain", "info"], env_extra=GPU_ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\s+[01]\s", line)]
    assert len(rows) == 2 and all("cuda:0" in row for row in rows), proc.stdout

"""The PyTorch DDP peer trains like hpctrain: from the same step-0 checkpoint, on the same rows in
the same order, with the same optimizer and schedule, its first steps' global losses agree with
hpctrain's. Skipped (with the reason printed) where PyTorch is not installed (setup.cfg extra
``peers``); the skip path of the peer itself is tested without torch.

Tolerances: float64 runs agree to 1e-9 relative (both sides sum in different orders, so not
bitwise); float32 runs to the 1e-4 that benchmarks/scaling.py states (measured: ~1e-7 over the
first 10 steps; the difference grows as rounding differences compound step by step).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH,
                                 reason="PyTorch not installed (pip install torch: setup.cfg extra peers)")
STEPS = 8


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def _both(small_data, tmp_path, ranks, *sets):
    common = [f"data.train={small_data[0]}", "data.eval=", "model.hidden=[32,32]", "train.global_batch=64",
              f"train.steps={STEPS}", "optim.warmup_steps=2", f"checkpoint.dir={tmp_path / 'ckpt'}",
              "checkpoint.every_minutes=0", "train.device=cpu", *sets]
    flags = [x for s in common for x in ("--set", s)]
    proc = subprocess.run([sys.executable, "benchmarks/peers/init_checkpoint.py", "--dir", str(tmp_path / "init"),
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    init = proc.stdout.strip().splitlines()[-1]
    out = {}
    for name, argv in (("hpctrain", ["-m", "hpctrain", "train"]), ("torch", ["benchmarks/peers/torch_ddp.py"])):
        metrics = tmp_path / f"{name}.jsonl"
        proc = run_mpi(ranks, argv + flags + ["--set", f"train.metrics={metrics}", "--resume", init])
        assert proc.returncode == 0, name + proc.stdout[-2000:] + proc.stderr[-2000:]
        out[name] = _losses(metrics)
    return out["hpctrain"], out["torch"]


def _max_rel(a, b):
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@needs_torch
def test_first_losses_agree_in_float64_at_2_ranks_sgd(small_data, tmp_path):
    hp, pt = _both(small_data, tmp_path, 2, "train.dtype=float64", "optim.name=sgd", "optim.nesterov=true",
                   "optim.weight_decay=0.01")
    assert _max_rel(hp, pt) < 1e-9, (hp, pt)
    assert hp[-1] < hp[0]  # it trains


@needs_torch
def test_first_losses_agree_in_float32_at_1_rank_adamw(small_data, tmp_path):
    hp, pt = _both(small_data, tmp_path, 1, "optim.name=adamw", "optim.lr=0.003", "optim.weight_decay=0.01",
                   "model.activation=gelu")
    assert _max_rel(hp, pt) < 1e-4, (hp, pt)


@needs_torch
def test_peer_refuses_settings_it_does_not_model(small_data, tmp_path):
    proc = run_mpi(1, ["benchmarks/peers/torch_ddp.py", "--set", f"data.train={small_data[0]}", "--set",
                       "train.grad_accum_steps=2", "--resume", str(tmp_path / "none.h5")])
    assert proc.returncode == 2 and "grad_accum_steps" in proc.stderr and "Traceback" not in proc.stderr


def test_peer_without_torch_exits_77_with_one_line(tmp_path, small_data):
    fake = tmp_path / "torch"  # shadows any installed torch: importing it fails as if it were absent
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no torch here (test)')\n")
    proc = subprocess.run([sys.executable, "benchmarks/peers/torch_ddp.py", "--set", f"data.train={small_data[0]}",
                           "--resume", str(tmp_path / "none.h5")], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 77, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "PyTorch is not installed" in proc.stderr

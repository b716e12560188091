"""The PyTorch DDP peers train like hpctrain: from the same step-0 checkpoint, on the same rows (the
MLP, benchmarks/peers/torch_ddp.py) or windows (the GPT, torch_gpt.py) in the same order, with the
same optimizer and schedule, their first steps' global losses agree with hpctrain's. Skipped (with
the reason printed) where PyTorch is not installed (setup.cfg extra ``peers``); the skip path of the
peers themselves is tested without torch.

Tolerances: float64 runs agree to 1e-9 relative (both sides sum in different orders, so not
bitwise; measured ~1e-15 for both models); float32 runs to the 1e-4 that benchmarks/scaling.py
states (measured: ~1e-7 over the first 10 steps; the difference grows as rounding differences
compound step by step).
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
# a 2-block GPT of 32 channels over 32-token windows: seconds per run, every op on the path
GPT = ["model.kind=gpt", "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.context=32",
       "train.global_batch=8", "train.eval_tokens=64", "optim.name=adamw", "optim.lr=0.003", "optim.weight_decay=0.1"]


def _metrics(path):
    return [json.loads(line) for line in open(path) if "step_time" in line]  # not hpctrain's evaluation line


def _mlp(small_data, *sets):
    return [f"data.train={small_data[0]}", "data.eval=", "model.hidden=[32,32]", "train.global_batch=64", *sets]


def _both(tmp_path, ranks, sets, peer="torch_ddp", full=False):
    """(hpctrain's losses, the peer's) of the same run; with ``full`` their metrics lines instead."""
    common = [f"train.steps={STEPS}", "optim.warmup_steps=2", f"checkpoint.dir={tmp_path / 'ckpt'}",
              "checkpoint.every_minutes=0", "train.device=cpu", *sets]
    flags = [x for s in common for x in ("--set", s)]
    proc = subprocess.run([sys.executable, "benchmarks/peers/init_checkpoint.py", "--dir", str(tmp_path / "init"),
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    init = proc.stdout.strip().splitlines()[-1]
    out = {}
    for name, argv in (("hpctrain", ["-m", "hpctrain", "train"]), ("torch", [f"benchmarks/peers/{peer}.py"])):
        metrics = tmp_path / f"{name}.jsonl"
        proc = run_mpi(ranks, argv + flags + ["--set", f"train.metrics={metrics}", "--resume", init])
        assert proc.returncode == 0, name + proc.stdout[-2000:] + proc.stderr[-2000:]
        out[name] = _metrics(metrics) if full else [m["loss"] for m in _metrics(metrics)]
    return out["hpctrain"], out["torch"]


def _max_rel(a, b):
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@needs_torch
def test_first_losses_agree_in_float64_at_2_ranks_sgd(small_data, tmp_path):
    hp, pt = _both(tmp_path, 2, _mlp(small_data, "train.dtype=float64", "optim.name=sgd", "optim.nesterov=true",
                                     "optim.weight_decay=0.01"))
    assert _max_rel(hp, pt) < 1e-9, (hp, pt)
    assert hp[-1] < hp[0]  # it trains


@needs_torch
def test_first_losses_agree_in_float32_at_1_rank_adamw(small_data, tmp_path):
    hp, pt = _both(tmp_path, 1, _mlp(small_data, "optim.name=adamw", "optim.lr=0.003", "optim.weight_decay=0.01",
                                     "model.activation=gelu"))
    assert _max_rel(hp, pt) < 1e-4, (hp, pt)


@needs_torch
def test_gpt_first_losses_agree_in_float32_at_2_ranks_with_op_times(text_data, tmp_path):
    hp, pt = _both(tmp_path, 2, [f"data.train={text_data}", *GPT, "train.op_times=true"], "torch_gpt", full=True)
    assert _max_rel([m["loss"] for m in hp], [m["loss"] for m in pt]) < 1e-4, (hp, pt)
    for m in pt:  # the peer's per-op split: hpctrain's families, DDP's wait, inside the step
        ops = {k for k in m if k.startswith("t_op_")}
        assert {f"t_op_{k}" for k in ("gemm", "attention", "layernorm", "embedding", "loss", "elementwise",
                                      "optimizer", "comm_wait")} == ops
        assert 0 < sum(m[k] for k in ops) <= m["step_time"] and m["tokens_per_s"] == pytest.approx(
            m["samples_per_s"] * 32)


@needs_torch
def test_gpt_first_losses_agree_in_float64_at_1_rank_sgd(text_data, tmp_path):
    hp, pt = _both(tmp_path, 1, [f"data.train={text_data}", *GPT, "train.dtype=float64", "optim.name=sgd",
                                 "optim.lr=0.1", "optim.nesterov=true"], "torch_gpt")
    assert _max_rel(hp, pt) < 1e-9, (hp, pt)
    assert hp[-1] < hp[0]  # it trains


@needs_torch
@pytest.mark.parametrize("peer, sets, why", [
    ("torch_ddp", ["train.grad_accum_steps=2"], "grad_accum_steps"),
    ("torch_gpt", [], "model.kind='mlp' (torch_gpt.py is the gpt peer; use torch_ddp.py)"),
])
def test_peer_refuses_settings_it_does_not_model(small_data, tmp_path, peer, sets, why):
    proc = run_mpi(1, [f"benchmarks/peers/{peer}.py", "--set", f"data.train={small_data[0]}",
                       *[x for s in sets for x in ("--set", s)], "--resume", str(tmp_path / "none.h5")])
    assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("does not model") == 1


@pytest.mark.parametrize("peer", ["torch_ddp", "torch_gpt"])
def test_peer_without_torch_exits_77_with_one_line(tmp_path, small_data, peer):
    fake = tmp_path / "torch"  # shadows any installed torch: importing it fails as if it were absent
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no torch here (test)')\n")
    proc = subprocess.run([sys.executable, f"benchmarks/peers/{peer}.py", "--set", f"data.train={small_data[0]}",
                           "--resume", str(tmp_path / "none.h5")], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 77, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "PyTorch is not installed" in proc.stderr

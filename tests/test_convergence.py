"""The main job reaches its accuracy target, as `make train` runs it (2 ranks here to save time)."""

import json
import re

import pytest

from conftest import run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_example_config_reaches_target(tmp_path):
    train, eval_ = tmp_path / "train.h5", tmp_path / "eval.h5"
    for path, n, seed in ((train, 65536, 1), (eval_, 8192, 2)):
        made = run_mpi(1, ["-m", "hpctrain", "data", "synth", "--out", str(path), "--n", str(n),
                           "--seed", str(seed)])
        assert made.returncode == 0, made.stderr
    metrics = tmp_path / "metrics.jsonl"
    proc = run_mpi(2, ["-m", "hpctrain", "train", "--config", "examples/mlp.toml",
                       "--set", f"data.train={train}", "--set", f"data.eval={eval_}",
                       "--set", f"train.metrics={metrics}"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    acc = float(re.search(r"final eval accuracy ([\d.]+)%", proc.stdout).group(1))
    assert acc >= 90.0  # the target stated in README and examples/mlp.toml (chance is ~10%)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 1500  # bounded: exactly train.steps steps
    assert records[-1]["loss"] < records[0]["loss"] / 5

"""benchmarks/compression.py runs and validates at a tiny size on 1 rank (a smoke
test: its numbers are not checked here, the comparison belongs to the benchmark).

Plain python, no mpirun: mpi4py starts as a singleton, so this is a serial test.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPECS = ["none", "fp16", "bf16", "topk(0.01)", "randk(0.01)", "sign", "powersgd(4)"]


def run_benchmark(tmp_path, *extra):
    out = tmp_path / "compression.json"
    proc = subprocess.run([sys.executable, "benchmarks/compression.py", "--mb", "1", "--warmup", "1",
                           "--repeats", "1", "--json", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    return proc, out


def test_compression_benchmark_part_a_prints_table_and_json(tmp_path):
    proc, out = run_benchmark(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("| compressor | ratio | sent/rank MB | enc+dec GB/s | median ms | min ms | max ms | x MPI "
            "| rel. error | #wrong | #differ |") in proc.stdout
    assert "FAIL" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    doc = json.loads(out.read_text())
    rows = {r["compressor"]: r for r in doc["rows"]}
    assert list(rows) == SPECS + ["MPI_Allreduce"]  # the yardstick in the same run
    assert all(r["ranks"] == 1 and r["bytes"] == 1 << 20 and r["median_s"] > 0 for r in rows.values())
    assert all(r["wrong"] == 0 and r["differ"] == 0 for r in rows.values())
    assert rows["none"]["rel_error"] == 0 and rows["fp16"]["rel_error"] < 1e-3  # 1 rank: only rounding
    assert sum(int(np.prod(s)) for s in doc["info"]["shapes"]) == (1 << 20) // 4


def test_compression_benchmark_unknown_compressor_is_one_clear_error(tmp_path):
    proc, out = run_benchmark(tmp_path, "--compressors", "none,zip(3)")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "zip(3)" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.skipif(not os.path.exists(os.path.join(REPO, "data", "synth-train.h5")),
                    reason="data/synth-*.h5 not made (python -m hpctrain data synth)")
def test_compression_benchmark_part_b_tiny_training(tmp_path):
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, "benchmarks/compression.py", "--train", "--launcher", "",
                           "--train-compressors", "none,topk(0.01)", "--window", "5",
                           "--set", "train.steps=20", "--set", "train.log_every=10", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| compressor | scope | steps | sent/rank/step MB |" in proc.stdout
    doc = json.loads(out.read_text())
    assert [r["spec"] for r in doc["rows"]] == ["none", "topk(0.01)"]
    assert all(r["n_steps"] == 20 and r["rc"] == 0 and r["ranks"] == 1 for r in doc["rows"])
    assert doc["rows"][0]["loss_vs_none"] == 1.0 and doc["info"]["seeds"] == [0]


def test_compression_benchmark_part_b_reports_a_failed_run_instead_of_crashing(tmp_path):
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, "benchmarks/compression.py", "--train", "--launcher", "",
                           "--train-compressors", "none,topk(0.01)", "--set", f'data.train="{tmp_path}/none.h5"',
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "none.h5" in proc.stderr  # each run's own error, shown
    assert "| none | all | 0 | - | - | - | - | - | - | - | - | 0/1 | - | - | - | - | 2 |" in proc.stdout
    doc = json.loads(out.read_text())
    assert [r["rc"] for r in doc["rows"]] == [2, 2] and all(r["target"] is None for r in doc["rows"])


def test_compression_benchmark_part_b_bad_spec_is_one_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/compression.py", "--train", "--launcher", "",
                           "--train-compressors", "none,topk(0.01):many", "--json", str(tmp_path / "x.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "topk(0.01):many" in proc.stderr and "Traceback" not in proc.stderr


def test_part_b_specs_name_compressor_momentum_scope_and_steps():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from compression_train import parse_spec

    assert parse_spec("topk(0.01)") == ("topk(0.01)", "", None, False)
    assert parse_spec("powersgd(4,10)+momentum@inter:1200") == ("powersgd(4,10)", "inter", 1200, True)
    assert parse_spec("fp16+momentum") == ("fp16", "", None, True)
    with pytest.raises(ValueError, match="only flag after"):
        parse_spec("topk(0.01)+velocity")
    with pytest.raises(ValueError, match="scope after"):
        parse_spec("topk(0.01)@inter+momentum")  # the flag goes before the scope


def test_part_b_checks_every_specs_config_before_training(tmp_path):
    # the MLP's example trains with SGD: momentum correction is refused there, before any run starts
    proc = subprocess.run([sys.executable, "benchmarks/compression.py", "--train", "--launcher", "",
                           "--train-compressors", "none,topk(0.01)+momentum", "--json", str(tmp_path / "x.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "topk(0.01)+momentum" in proc.stderr and "adamw" in proc.stderr, proc.stderr
    assert "training with" not in proc.stderr and "Traceback" not in proc.stderr

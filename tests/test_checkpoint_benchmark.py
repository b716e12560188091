"""benchmarks/checkpoint.py runs and validates at a tiny size on 1 rank (a smoke
test: its numbers are not checked here, the target belongs to the benchmark).

Plain python, no mpirun: mpi4py starts as a singleton, so this is a serial test.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_benchmark(tmp_path, *extra):
    out, target = tmp_path / "checkpoint.json", tmp_path / "ckpt-bench"
    proc = subprocess.run([sys.executable, "benchmarks/checkpoint.py", "--sizes", "1M", "--repeats", "1",
                           "--dir", str(target), "--json", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    return proc, out, target


def test_checkpoint_benchmark_prints_table_validates_and_cleans_up(tmp_path):
    proc, out, target = run_benchmark(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| state | bytes | ranks | op | median s | min s | max s | GB/s | x raw |" in proc.stdout
    assert "h5py MPI:" in proc.stdout and "target save >= 0.8x raw write" in proc.stdout
    assert "FAIL" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["wrong"] == {"1M": 0}
    assert {r["op"] for r in doc["rows"]} == {"raw write", "save", "raw read", "load"}  # no raw p* on 1 rank
    assert all(r["ranks"] == 1 and r["median_s"] > 0 and r["gbps"] > 0 for r in doc["rows"])
    assert not target.exists()  # every file removed, and the directory it made


def test_checkpoint_benchmark_collective_row(tmp_path):
    proc, out, _ = run_benchmark(tmp_path, "--collective")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "save coll." in {r["op"] for r in json.loads(out.read_text())["rows"]}


def test_checkpoint_benchmark_bad_size_is_one_clear_error(tmp_path):
    proc, out, _ = run_benchmark(tmp_path, "--sizes", "12Q")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--sizes" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_checkpoint_benchmark_refuses_a_directory_with_checkpoints(tmp_path):
    target = tmp_path / "ckpt-bench"
    target.mkdir()
    (target / "ckpt-00000001.h5").write_bytes(b"someone's checkpoint")
    proc, _, _ = run_benchmark(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds checkpoints" in proc.stderr
    assert (target / "ckpt-00000001.h5").read_bytes() == b"someone's checkpoint"

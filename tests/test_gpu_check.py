"""scripts/gpu-check.sh --simulate: the one-command GPU validation, dry-run on numba's CUDA
simulator with tiny sizes (no GPU here). Every step the real check runs must run and pass
(the two test steps and the PyTorch comparison are reported as skipped), and the report must
say what ran: 1- and 2-rank training on the cuda device end with the same loss. The kernel
benchmark step is skipped here too (GPU_CHECK_SKIP, which this also checks): its command,
benchmarks/kernels.py --small --repeats 1 --warmup 0, is test_benchmarks.py's, and running
it twice would cost the suite a minute."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_gpu_check_dry_run_on_the_simulator(tmp_path):
    out = tmp_path / "check"
    env = dict(os.environ, HPCTRAIN_PYTHON=sys.executable, GPU_CHECK_SKIP="kernels")
    env.pop("NUMBA_ENABLE_CUDASIM", None)   # the script sets it itself
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu-check.sh"), "--simulate", str(out)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=840)
    report = (out / "gpu-check.md").read_text() if (out / "gpu-check.md").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + report[-3000:]
    doc = json.loads((out / "gpu-check.json").read_text())
    assert doc["passed"] is True
    ran = {s["name"]: s["rc"] for s in doc["steps"]}
    assert ran == {"gpu-tests": None, "gpu-tests-mpi": None, "kernels": None, "gpu-step": 0, "data": 0, "mlp-cuda-1": 0,
                   "gpt-cuda-1": 0, "mlp-cuda-2": 0, "gpt-cuda-2": 0, "gpt-vs-torch": None}
    assert doc["skipped"] == ["gpu-tests", "gpu-tests-mpi", "kernels", "gpt-vs-torch"]
    assert "numba CUDA simulator" in doc["env"][0]
    runs = doc["runs"]
    assert runs["gpt-1"]["steps"] == runs["gpt-2"]["steps"] == runs["mlp-1"]["steps"] == runs["mlp-2"]["steps"] == 2
    assert runs["gpt-1"]["loss"] == pytest.approx(runs["gpt-2"]["loss"], rel=1e-6)   # 2 ranks = 1 rank
    assert runs["mlp-1"]["loss"] == pytest.approx(runs["mlp-2"]["loss"], rel=1e-6)
    assert "**PASSED** (skipped: gpu-tests, gpu-tests-mpi, kernels, gpt-vs-torch)" in report
    # the GPT step benchmark: a tiny GPT on the simulator, validated against its float64 CPU twin
    # (fp32, and bf16 mixed precision)
    rows = doc["gpu_step"]["rows"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    for row in rows:
        assert row["shape"] == "tiny" and row["valid"] is True and row["validated_against"] == "hpctrain float64 CPU"
        assert row["launches_per_step"] > 0 and row["ops_ms"]["gemm"] > 0
        assert row["graphs"] == "eager (numba's CUDA simulator has no graphs)"
    assert rows[1]["activation_bytes"] < rows[0]["activation_bytes"]
    assert "## A GPT step against PyTorch eager (benchmarks/gpu_step.py)" in report
    assert "| tiny | fp32 | 16 | yes" in report and "| tiny | bf16 | 16 | yes" in report


def test_a_step_the_budget_cannot_start_fails_the_check(tmp_path):
    """GPU_CHECK_BUDGET_S: with 15 s (the report's 10 s reserved) no step can start; each is
    recorded as out of budget, not as skipped, and the check does not pass."""
    out = tmp_path / "check"
    env = dict(os.environ, HPCTRAIN_PYTHON=sys.executable, GPU_CHECK_BUDGET_S="15", GPU_CHECK_SKIP="gpu-tests")
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu-check.sh"), "--simulate", str(out)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]   # exit 0 only when every step passed
    doc = json.loads((out / "gpu-check.json").read_text())
    assert doc["passed"] is False
    budget = [s["name"] for s in doc["steps"] if s.get("budget")]
    assert budget == ["kernels", "gpu-step", "data", "mlp-cuda-1", "gpt-cuda-1", "mlp-cuda-2", "gpt-cuda-2"]
    report = (out / "gpu-check.md").read_text()
    assert "**FAILED**" in report and "| data | out of budget |" in report


def test_a_real_check_without_pytest_mpi_fails_and_says_why(tmp_path):
    """Not simulated, every other step left out: when pytest-mpi cannot be imported the 2-rank
    CUDA tests did not run, so the step fails with the fix in the report (it used to be recorded
    as skipped, and the check passed); GPU_CHECK_SKIP naming the step is the explicit way to
    leave it out, recorded as skipped."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pytest_mpi.py").write_text("raise ImportError('hidden by the test')\n")
    others = "gpu-tests kernels gpu-step data mlp-cuda-1 gpt-cuda-1 mlp-cuda-2 gpt-cuda-2 gpt-vs-torch"
    steps = {}
    for name, skip in (("missing", others), ("left-out", others + " gpu-tests-mpi")):
        out = tmp_path / name
        env = dict(os.environ, HPCTRAIN_PYTHON=sys.executable, GPU_CHECK_SKIP=skip, PYTHONPATH=str(shadow))
        proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu-check.sh"), str(out)], cwd=str(tmp_path),
                              env=env, capture_output=True, text=True, timeout=120)
        # exit 1 both times: the first has a failed step, the second ran none (a check of nothing fails)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        steps[name] = {s["name"]: s["rc"] for s in json.loads((out / "gpu-check.json").read_text())["steps"]}
        steps[name]["report"] = (out / "gpu-check.md").read_text()
    assert steps["missing"]["gpu-tests-mpi"] == 127
    assert "pytest-mpi is not importable" in steps["missing"]["report"]
    assert "pip install pytest-mpi" in steps["missing"]["report"]
    assert steps["left-out"]["gpu-tests-mpi"] is None and "pytest-mpi" not in steps["left-out"]["report"]

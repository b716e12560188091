"""benchmarks/scaling.py runs end to end at a tiny size (a smoke test: its numbers are not checked,
the comparison belongs to the benchmark), and ``python -m hpctrain bench report`` rebuilds its
table (and plots, where matplotlib is installed) from the JSON alone.

The driver is plain python and launches mpirun itself, so these are serial tests.
"""

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HEAD = ("| model | trainer | ranks | global batch | samples/s | step ms | p10-p90 | data | forward | backward "
        "| exposed comm | optimizer | checkpoint | other | comm ms | comm/compute | speedup | efficiency |")


def _scaling(out, *extra, timeout=280):
    return subprocess.run([sys.executable, "benchmarks/scaling.py", "--out", str(out), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    # the peer is left out here (tests/test_torch_peer.py covers it, and it needs torch)
    proc = _scaling(out, "--models", "tiny=8-16", "--ranks", "1", "2", "--steps", "3", "--warmup", "1",
                    "--samples", "2048", "--batch", "32", "--peer-models", "", "--trace-config", "tiny:2",
                    "--ckpt-every", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_scaling_writes_json_table_and_trace(bench):
    out, proc = bench
    assert HEAD in proc.stdout and "## Strong scaling" in proc.stdout and "## Weak scaling" in proc.stdout
    doc = json.loads((out / "scaling.json").read_text())
    rows = doc["rows"]
    assert sorted((r["mode"], r["ranks"], r["global_batch"]) for r in rows) == [
        ("strong", 1, 64), ("strong", 2, 64), ("weak", 1, 32), ("weak", 2, 64)]
    for r in rows:
        assert r["trainer"] == "hpctrain" and r["rc"] == 0 and r["steps_timed"] == 3
        assert r["step_ms"]["median"] > 0 and r["comm_ms"] is not None
        assert set(r["split_ms"]) == {"data", "forward", "backward", "exposed_comm", "optimizer", "checkpoint",
                                      "other"}
        assert r["split_ms"]["checkpoint"] > 0  # --ckpt-every 2 saves inside the timed steps
    assert doc["models"]["tiny"]["params"] == 8 * 16 + 16 + 16 * 10 + 10
    assert doc["machine"]["cores"] >= 1 and doc["args"]["threads_per_rank"] >= 1
    assert doc["traces"] == ["trace/hpctrain-tiny-n2.json"]
    events = json.loads((out / doc["traces"][0]).read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


def test_bench_report_rebuilds_the_table_from_the_json(bench):
    out, _ = bench
    table = (out / "scaling.md").read_text()
    (out / "scaling.md").unlink()
    for png in ("scaling.png", "split.png"):
        (out / png).unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "bench", "report", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "scaling.md").read_text() == table and HEAD in proc.stdout
    if importlib.util.find_spec("matplotlib"):
        assert (out / "scaling.png").stat().st_size > 0 and (out / "split.png").stat().st_size > 0
    else:
        assert "plots skipped" in proc.stdout


def test_bench_report_without_json_is_one_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "bench", "report", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "scaling.json" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_model_is_one_clear_error(tmp_path):
    proc = _scaling(tmp_path, "--models", "huge", timeout=60)
    assert proc.returncode == 2 and "unknown model 'huge'" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_report_joins_the_parts_of_a_job_array(bench, tmp_path):
    out, _ = bench
    doc = json.loads((out / "scaling.json").read_text())
    for n in (1, 2):  # as if each array task had run one rank count
        part = tmp_path / f"ranks-{n}"
        part.mkdir()
        (part / "scaling.json").write_text(json.dumps(dict(doc, rows=[r for r in doc["rows"] if r["ranks"] == n])))
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "bench", "report", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = lambda text: [line for line in text.splitlines() if line.startswith("| tiny | hpctrain")]  # noqa: E731
    assert rows((tmp_path / "scaling.md").read_text()) == rows((out / "scaling.md").read_text())

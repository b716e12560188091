"""benchmarks/scaling.py runs end to end at a tiny size (a smoke test: its numbers are not checked,
the comparison belongs to the benchmark), and ``python -m hpctrain bench report`` rebuilds its
table (and plots, where matplotlib is installed) from the JSON alone.

The driver is plain python and launches mpirun itself, so these are serial tests.
"""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HEAD = ("| model | trainer | ranks | global batch | samples/s | tokens/s | step ms | p10-p90 | data | forward "
        "| backward | exposed comm | optimizer | checkpoint | other | comm ms | comm/compute | speedup "
        "| efficiency |")
OPS = {"gemm", "attention", "layernorm", "embedding", "loss", "elementwise", "optimizer"}


def _scaling(out, *extra, timeout=280):
    return subprocess.run([sys.executable, "benchmarks/scaling.py", "--out", str(out), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


# hpctrain's runs reduce with MPI_Allreduce, not the benchmark's default auto: auto's fit cache
# holds one world shape, so every 2-rank run here measured it again (~3 s each, ~12 of the MLP
# sweep's ~50 s) for numbers no test reads; auto in the trainer is tests/test_mpi_buckets.py's
ALLREDUCE = ("--allreduce", "mpi")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    # the peer is left out here (tests/test_torch_peer.py covers it, and it needs torch)
    proc = _scaling(out, "--models", "tiny=8-16", "--ranks", "1", "2", "--steps", "3", "--warmup", "1",
                    "--samples", "2048", "--batch", "32", "--peer-models", "", "--trace-config", "tiny:2",
                    "--ckpt-every", "2", *ALLREDUCE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_scaling_writes_json_table_and_trace(bench):
    out, proc = bench
    assert HEAD in proc.stdout and "## Strong scaling" in proc.stdout and "## Weak scaling" in proc.stdout
    doc = json.loads((out / "scaling.json").read_text())
    rows = doc["rows"]
    assert sorted((r["trainer"], r["mode"], r["ranks"], r["global_batch"]) for r in rows) == [
        ("hpctrain", "strong", 1, 64), ("hpctrain", "strong", 2, 64), ("hpctrain", "weak", 1, 32),
        ("hpctrain", "weak", 2, 64), ("independent", "weak", 1, 32), ("independent", "weak", 2, 64)]
    for r in rows:
        assert r["rc"] == 0 and r["steps_timed"] == 3
        assert r["step_ms"]["median"] > 0 and r["comm_ms"] is not None
        assert set(r["split_ms"]) == {"data", "forward", "backward", "exposed_comm", "optimizer", "checkpoint",
                                      "other"}
        assert r["split_ms"]["checkpoint"] > 0  # --ckpt-every 2 saves inside the timed steps
    assert doc["models"]["tiny"]["params"] == 8 * 16 + 16 + 16 * 10 + 10
    assert doc["machine"]["cores"] >= 1 and doc["args"]["threads_per_rank"] >= 1
    assert "## Weak scaling against the machine's ceiling" in proc.stdout
    assert any(line.startswith("| tiny | 2 | ") for line in proc.stdout.splitlines())
    # the ceiling's rank 1 trained a copy of its own (and checkpointed apart from rank 0)
    assert list((out / "ckpt" / "tiny" / "independent-rank1").glob("ckpt-*.h5"))
    assert doc["traces"] == ["trace/hpctrain-tiny-n2.json"]
    events = json.loads((out / doc["traces"][0]).read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


@pytest.fixture(scope="module")
def gpt_bench(tmp_path_factory, text_data):
    """A 1-block GPT of 32 channels, weak scaling at 1 and 2 ranks, with its peer (skipped without torch)."""
    out = tmp_path_factory.mktemp("scaling-gpt")
    proc = _scaling(out, "--models", "gt=gpt:1-32-2-32", "--ranks", "1", "2", "--modes", "weak", "--steps", "3",
                    "--warmup", "1", "--batch", "8", "--text", text_data, "--peer-models", "gt",
                    "--ceiling-models", "", "--trace-config", "", *ALLREDUCE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_scaling_runs_a_gpt_with_tokens_per_s_and_a_per_op_table(gpt_bench):
    out, proc = gpt_bench
    doc = json.loads((out / "scaling.json").read_text())
    hp = sorted((r for r in doc["rows"] if r["trainer"] == "hpctrain"), key=lambda r: r["ranks"])
    assert [(r["ranks"], r["global_batch"], r["tokens_per_row"]) for r in hp] == [(1, 8, 32), (2, 16, 32)]
    for r in hp:
        assert r["rc"] == 0 and r["steps_timed"] == 3 and set(r["ops_ms"]) == OPS
    C, L = 32, 1  # wte (256 bytes), wpe, per block 12 C^2 + 13 C, ln_f
    assert doc["models"]["gt"]["params"] == 256 * C + 32 * C + L * (12 * C * C + 13 * C) + 2 * C
    assert HEAD in proc.stdout and "## Per-op time: gt" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("| gt | hpctrain | 1 | 8 | "))
    tokens = float(line.split("|")[6].replace(",", ""))
    # the trainer's own count: the median of the timed steps' tokens_per_s in the run's metrics
    steps = [json.loads(x) for x in (out / "runs" / "hpctrain-gt-weak-n1.jsonl").read_text().splitlines()]
    measured = float(np.median([s["tokens_per_s"] for s in steps if "step_time" in s][1:]))
    assert tokens == pytest.approx(measured, rel=0.02, abs=1)
    peer = [r for r in doc["rows"] if r["trainer"] == "torch_gpt"]
    if doc["peer_skipped"]:  # no torch here (CI): said once, the hpctrain rows stand
        assert not peer and "PyTorch peer skipped" in proc.stdout
    else:
        assert [r["ranks"] for r in peer] == [1, 2] and all(set(r["ops_ms"]) == OPS | {"comm_wait"} for r in peer)
        assert "| weak | 2 | hpctrain / PyTorch |" in proc.stdout
    # python -m hpctrain bench report rebuilds the same tables from the JSON
    table = (out / "scaling.md").read_text()
    (out / "scaling.md").unlink()
    rebuilt = subprocess.run([sys.executable, "-m", "hpctrain", "bench", "report", str(out)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0 and (out / "scaling.md").read_text() == table, rebuilt.stderr


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="the sweep binds a rank to 2 cores")
def test_thread_sweep_runs_each_way_to_use_the_cores_with_the_bindings_reported(tmp_path, text_data):
    """--thread-sweep: 1 rank x 1 thread, 1 x 2 and 2 x 1 at one global batch, each with the
    launcher's report of every rank's binding (2 x 1: two ranks, one core each), and the table;
    the peer's rows where torch runs (here or on a GPU machine), said skipped where it does not."""
    proc = _scaling(tmp_path, "--models", "gt=gpt:1-32-2-32", "--thread-sweep", "--steps", "2", "--warmup", "1",
                    "--batch", "4", "--text", text_data, *ALLREDUCE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "threads.json").read_text())
    assert [(r["ranks"], r["threads"], r["global_batch"]) for r in doc["rows"]] == [(1, 1, 8), (1, 2, 8), (2, 1, 8)]
    for r in doc["rows"]:
        ours = r["hpctrain"]
        assert ours["rc"] == 0 and ours["tokens_per_s"] > 0 and len(ours["bindings"]) == r["ranks"], r
        assert "skipped" in r["peer"] or r["peer"]["rc"] == 0, r
    one_each = doc["rows"][2]["hpctrain"]["bindings"]
    assert one_each[0].startswith("rank 0: [") and one_each[1].startswith("rank 1: [") and "B" in one_each[1]
    assert "| gt | 2 x 1 |" in proc.stdout and (tmp_path / "threads.md").exists()


def test_op_table_sets_hpctrain_beside_the_peer_with_their_ratio():
    from hpctrain.observe import bench_report

    def row(trainer, ops, exposed):
        return {"trainer": trainer, "model": "g", "mode": "weak", "ranks": 2, "global_batch": 8, "per_rank_batch": 4,
                "tokens_per_row": 16, "rc": 0, "step_ms": {"median": 10.0, "mean": 10.0},
                "split_ms": {"exposed_comm": exposed}, "comm_ms": None, "ops_ms": ops}

    ops = {k: 1.0 for k in OPS}
    doc = {"machine": {"cores": 2}, "args": {}, "models": {"g": {"kind": "gpt", "params": 1}},
           "rows": [row("hpctrain", dict(ops, elementwise=4.0), 0.5), row("torch_gpt", dict(ops, comm_wait=1.0), 9.0)]}
    lines = bench_report.op_tables(doc, bench_report.derive(doc))
    assert lines[3] == ("| mode | ranks | trainer | gemm | attention | layernorm | embedding | loss | elementwise | "
                        "optimizer | exposed comm | sum | step |")
    assert lines[5] == "| weak | 2 | hpctrain | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 4.00 | 1.00 | 0.50 | 10.50 | 10.00 |"
    assert lines[6] == "| weak | 2 | PyTorch | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 8.00 | 10.00 |"
    assert lines[7].startswith("| weak | 2 | hpctrain / PyTorch | 1.00x | ") and "| 4.00x | 1.00x | 0.50x |" in lines[7]
    (d,) = bench_report.derive(doc)[:1]
    assert d["tokens_per_s"] == pytest.approx(8 / 0.01 * 16)


def test_bench_report_reads_a_json_from_before_the_gpt():
    from hpctrain.observe import bench_report

    doc = {"machine": {"cores": 2}, "args": {"batch": 32, "strong_batch": 64},
           "models": {"m": {"dim": 8, "hidden": [16], "classes": 10, "params": 314}},   # no kind, no batches
           "rows": [{"trainer": "torch_ddp", "model": "m", "mode": "weak", "ranks": 1, "global_batch": 32,
                     "per_rank_batch": 32, "rc": 0, "step_ms": {"median": 2.0, "p10": 1.0, "p90": 3.0, "mean": 2.0},
                     "split_ms": {}, "comm_ms": None}]}
    text = bench_report.tables(doc)
    assert "| m | MLP 8-16-10 | 314 | 0.00 | 32 | 64 |" in text
    assert "## Weak scaling: per-rank batch fixed (m 32)" in text
    assert "| m | torch_ddp | 1 | 32 | 16,000 | - | 2.00 |" in text and "Per-op" not in text


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
    rows = lambda text: [line for line in text.splitlines() if line.startswith("| tiny |")]  # noqa: E731
    assert rows((tmp_path / "scaling.md").read_text()) == rows((out / "scaling.md").read_text())


def test_ceiling_compares_hpctrain_with_independent_runs_at_the_same_ranks():
    from hpctrain.observe import bench_report

    def row(trainer, ranks, step_ms, mode="weak"):
        return {"trainer": trainer, "model": "m", "mode": mode, "ranks": ranks, "global_batch": 100 * ranks,
                "per_rank_batch": 100, "rc": 0, "step_ms": {"median": step_ms}, "split_ms": {}, "comm_ms": None}

    doc = {"machine": {"cores": 4}, "rows": [row("hpctrain", 1, 10.0), row("hpctrain", 2, 12.5),
                                             row("independent", 1, 10.0), row("independent", 2, 10.5),
                                             row("hpctrain", 4, 20.0)]}   # no ceiling at 4: not reported
    (c,) = bench_report.ceilings(bench_report.derive(doc))
    assert (c["model"], c["ranks"]) == ("m", 2)
    assert c["efficiency"] == pytest.approx(0.8) and c["ceiling_efficiency"] == pytest.approx(10 / 10.5)
    assert c["of_ceiling"] == pytest.approx(10.5 / 12.5)


def test_independent_peer_with_a_batch_the_ranks_cannot_share_is_one_clear_error(tmp_path):
    from conftest import run_mpi

    proc = run_mpi(2, ["benchmarks/peers/independent.py", "--set", "train.global_batch=33",
                       "--set", f'checkpoint.dir="{tmp_path}"'])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("train.global_batch=33 is not divisible by 2 ranks") == 1
    assert "Traceback" not in proc.stderr

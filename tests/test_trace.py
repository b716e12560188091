"""Timelines: ``train --trace DIR`` writes a valid Chrome trace per rank with the expected spans,
and ``trace merge`` joins them into one file with a track per rank.

Serial tests that launch ``mpirun -n 2`` themselves (see conftest.py).
"""

import json
import subprocess
import sys
from collections import Counter

import pytest

from conftest import REPO, run_mpi

pytestmark = pytest.mark.timeout(180)

STEPS = 3


def _train(small_data, tmp_path, *extra):
    return run_mpi(2, ["-m", "hpctrain", "train", "--set", f"data.train={small_data[0]}", "--set", "data.eval=",
                       "--set", "train.metrics=", "--set", "model.hidden=[32,16]", "--set", "train.global_batch=64",
                       "--set", f"train.steps={STEPS}", "--set", "checkpoint.save_final=true",
                       "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "checkpoint.every_minutes=0",
                       # tiny buckets: 3 layers -> several buckets, so overlap and ordering show
                       "--set", "dist.bucket_mb=0.001", "--set", "dist.first_bucket_mb=0.001", *extra])


@pytest.fixture(scope="module")
def traced(small_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    proc = _train(small_data, tmp, "--trace", str(tmp / "tr"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return tmp


def _load(path):
    with open(path) as fh:
        return json.load(fh)["traceEvents"]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_writes_a_chrome_trace_with_the_expected_spans(traced, rank):
    events = _load(traced / "tr" / f"trace-rank{rank:05d}.json")
    assert {e["pid"] for e in events} == {rank}
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["comm", "main"]
    main, comm = (next(t for t, n in threads.items() if n == name) for name in ("main", "comm"))
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    count = Counter((e["name"], e["tid"]) for e in spans)
    for name in ("step", "data", "forward", "backward", "forward fc0", "forward fc1", "forward fc2",
                 "forward loss", "backward loss", "backward fc2", "backward fc1", "backward fc0"):
        assert count[(name, main)] >= STEPS, (name, count)
    for name in ("allreduce wait", "optimizer"):  # once per bucket and step
        assert count[(name, main)] >= 2 * STEPS, (name, count)
    assert count[("checkpoint", main)] == 1  # save_final
    ready = [e for e in events if e["name"] == "bucket ready"]
    reduced = [e for e in spans if e["name"].startswith("comm bucket")]
    n_buckets = len({e["args"]["bucket"] for e in ready})
    assert n_buckets >= 2 and all(e["ph"] == "i" for e in ready)
    assert len(ready) == len(reduced) == n_buckets * STEPS
    for e in reduced:
        # the last bucket goes to the main thread when the comm thread is idle by then (comm/buckets.py)
        assert e["tid"] == comm or (e["tid"] == main and e["args"]["bucket"] == n_buckets - 1), e
        assert e["args"]["strategy"] == "mpi" and e["args"]["bytes"] > 0
    # causality: the k-th reduction of bucket i starts after its k-th "ready"
    for i in range(n_buckets):
        r = sorted(e["ts"] for e in ready if e["args"]["bucket"] == i)
        c = sorted(e["ts"] for e in reduced if e["args"]["bucket"] == i)
        assert all(t_c >= t_r for t_r, t_c in zip(r, c))
    steps = sorted(e["args"]["step"] for e in spans if e["name"] == "step")
    assert steps == list(range(1, STEPS + 1))  # numbered as in the metrics


def test_merge_makes_one_file_with_a_track_per_rank(traced):
    out = traced / "merged.json"
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "trace", "merge", str(traced / "tr"), "-o", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    merged = _load(out)
    per_rank = [_load(traced / "tr" / f"trace-rank{r:05d}.json") for r in (0, 1)]
    assert len(merged) == sum(map(len, per_rank))
    assert {e["args"]["name"].split()[1] for e in merged if e["name"] == "process_name"} == {"0", "1"}
    # the ranks share a time base (a common barrier): their first steps start within a second
    first = [min(e["ts"] for e in merged if e["pid"] == r and e["name"] == "step") for r in (0, 1)]
    assert abs(first[0] - first[1]) < 1e6


def test_merge_of_a_directory_without_traces_is_one_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "trace", "merge", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no trace-rank*.json" in proc.stderr and "Traceback" not in proc.stderr


def test_unwritable_trace_directory_is_one_clear_error(small_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = _train(small_data, tmp_path, "--trace", str(blocker / "tr"))
    errors = [line for line in proc.stderr.splitlines() if "hpctrain: error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "train.trace" in errors[0], proc.stderr


def test_tracing_off_leaves_no_tracer(small_data, tmp_path):
    from hpctrain.training.config_load import load_config
    from hpctrain.observe.log import Log, Timers
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer
    from mpi4py import MPI

    cfg = load_config(None, [f"data.train={small_data[0]}", "model.hidden=[8]", "train.global_batch=32",
                             f"checkpoint.dir={tmp_path}"])
    trainer = Trainer(cfg, init_world(MPI.COMM_SELF), Log(False))
    assert trainer.tracer is None and trainer.model.tracer is None and trainer.stepper.reducer.tracer is None
    assert type(trainer.timers) is Timers

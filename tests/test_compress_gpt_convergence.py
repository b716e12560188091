"""Compression on a small GPT, trained to the end by ``benchmarks/compression.py --train --model gpt``.

One run each of none, powersgd(4) and topk(0.01), the last two also with momentum correction
(``dist.compress_momentum``), under ``mpirun -n 2`` (1 block, d 64, 4 heads,
context 32, 16 windows a step, 150 steps; compression and AdamW's frozen second moment from step 30,
as examples/gpt-compress.toml does from step 100) on the small json + email corpus of conftest.
The numbers asserted come from the runs: the payload bytes per step against the closed form of
this model's shapes, the final validation loss against the uncompressed run's, and the benchmark's
own table and JSON. Serial test (it launches mpirun); about 25 s on 2 cores.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SPECS = ["none", "powersgd(4)", "topk(0.01)", "powersgd(4)+momentum", "topk(0.01)+momentum"]
D, T, V, STEPS = 64, 32, 256, 150
SETS = ["model.n_layer=1", f"model.d_model={D}", f"model.context={T}", "train.global_batch=16",
        f"train.steps={STEPS}", "train.eval_every=25", "train.eval_tokens=8192", "optim.warmup_steps=20",
        "optim.freeze_step=30", "dist.compress_start_step=30"]
# the final validation loss over the uncompressed run's, measured on 2 cores for train.seed 0, 1, 2,
# 3: powersgd(4) 0.998, 0.985, 1.005, 1.004 (2026-11-27, the QKV weight as three matrices);
# topk(0.01) 1.042, 1.048, 1.023, 1.038 (2026-11-25). A BLAS that rounds differently acts like
# another seed, so the margins sit above the worst seed by about 2 % and 3 %.
POWERSGD_MARGIN, TOPK_MARGIN = 1.03, 1.08
# with momentum correction, measured 2026-11-27 the same way: powersgd(4) 1.019, 0.966, 1.021, 1.044;
# topk(0.01) 1.018, 0.979, 1.023, 1.032 (this small model's PowerSGD is near exact already; top-k
# gains at every seed)
POWERSGD_MOMENTUM_MARGIN, TOPK_MOMENTUM_MARGIN = 1.06, 1.05


def powersgd_values(rank=4):
    """Values rank-r PowerSGD sends per step for this GPT: r (rows + cols) per matrix it shrinks (the
    QKV weight is three), every vector (13 d per block, ln_f's 2 d) as it is; and the model's
    parameter count."""
    # (rows, cols, parts): c_attn (q, k, v), attn proj, fc, mlp proj, wte, wpe
    matrices = [(D, D, 3), (D, D, 1), (D, 4 * D, 1), (4 * D, D, 1), (V, D, 1), (T, D, 1)]
    sent = sum(k * (rank * (n + m) if rank * (n + m) < n * m else n * m) for n, m, k in matrices) + 15 * D
    return sent, sum(n * m * k for n, m, k in matrices) + 15 * D


@pytest.fixture(scope="module")
def bench(text_data_wide_val, tmp_path_factory):
    text_data = text_data_wide_val
    out = tmp_path_factory.mktemp("gpt-compress") / "compression.json"
    cmd = [sys.executable, "benchmarks/compression.py", "--train", "--model", "gpt", "--launcher",
           "mpirun -n 2 --oversubscribe", "--train-compressors", ",".join(SPECS), "--json", str(out),
           "--set", f'data.train="{text_data}"', *(a for s in SETS for a in ("--set", s))]
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540, env={**os.environ, **env})
    print(proc.stdout)  # the table, for the log
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    return proc.stdout, {r["spec"]: r for r in doc["rows"]}, {s["spec"]: s for s in doc["summary"]}


def test_every_run_trained_to_the_end(bench):
    _, rows, _ = bench
    assert list(rows) == SPECS
    for r in rows.values():
        assert r["rc"] == 0 and r["n_steps"] == STEPS and r["ranks"] == 2, r
        assert math.isfinite(r["final_loss"]) and len(r["curve"]) == STEPS // 25 - 1  # evaluations before the last


def test_powersgd_sends_the_closed_form_of_this_gpts_shapes(bench):
    _, rows, _ = bench
    sent, total = powersgd_values()
    r = rows["powersgd(4)"]
    assert r["step_dense_bytes"] == 4 * total  # 2 ranks: 2 (p - 1) / p of the float32 gradient = all of it
    assert r["step_sent_bytes"] == 4 * sent, (r["step_sent_bytes"], 4 * sent)


def test_topk_sends_about_one_percent(bench):
    # 2 ranks: one payload of 6 bytes (float32 value, 16-bit offset) per kept entry against 4 per
    # gradient value, plus a block count per bucket and the rounding up of k per bucket
    _, _, summary = bench
    assert 60 <= summary["topk(0.01)"]["step_ratio"] <= 400 / 6


def test_compressed_validation_loss_stays_near_uncompressed(bench):
    _, rows, _ = bench
    none = rows["none"]["final_loss"]
    assert none < 0.75 * math.log(V)  # it learned: the uniform guess is ln 256 = 5.55
    assert rows["powersgd(4)"]["final_loss"] <= POWERSGD_MARGIN * none, rows["powersgd(4)"]["final_loss"] / none
    assert rows["topk(0.01)"]["final_loss"] <= TOPK_MARGIN * none, rows["topk(0.01)"]["final_loss"] / none
    for spec, margin in (("powersgd(4)+momentum", POWERSGD_MOMENTUM_MARGIN),
                         ("topk(0.01)+momentum", TOPK_MOMENTUM_MARGIN)):
        assert rows[spec]["final_loss"] <= margin * none, (spec, rows[spec]["final_loss"] / none)
        assert rows[spec]["final_loss"] != rows[spec.split("+")[0]]["final_loss"]  # the correction was on


def metrics(row):
    return [json.loads(line) for line in open(row["metrics"])]


def test_warm_up_steps_send_the_dense_bytes(bench):
    # steps 0..29 exact (dense bytes), 30..149 compressed: the run's ratio is far below the step's
    _, rows, summary = bench
    r = rows["powersgd(4)"]
    sent = [m["bytes_sent"] for m in metrics(r)]
    assert sent[:30] == [r["step_dense_bytes"]] * 30 and sent[30:] == [r["step_sent_bytes"]] * 120
    assert r["bytes_sent"] == 30 * r["step_dense_bytes"] + 120 * r["step_sent_bytes"]
    assert summary["powersgd(4)"]["run_ratio"] < summary["powersgd(4)"]["step_ratio"] / 2


def test_time_to_target_is_read_off_the_runs_own_metrics(bench):
    # recomputed here from the metrics files: the target is 1.02 x the uncompressed run's last
    # evaluation before the final (whole-split) one; a run reaches it at its first evaluation
    # at or below it, after the sum of its step times up to there
    stdout, rows, summary = bench
    assert "| compressor | scope | steps | sent/rank/step MB | ratio (step) |" in stdout
    none_evals = [m["val_loss"] for m in metrics(rows["none"])[:-1] if "val_loss" in m]
    target = 1.02 * none_evals[-1]
    for spec, r in rows.items():
        assert r["target"] == pytest.approx(target)
        ms = metrics(r)
        hit = next((i for i, m in enumerate(ms[:-1]) if m.get("val_loss", math.inf) <= target), None)
        if hit is None:
            assert r["target_s"] is None and summary[spec]["reached"] == 0, spec
        else:
            assert r["target_step"] == ms[hit]["step"], spec
            assert r["target_s"] == pytest.approx(sum(m["step_time"] for m in ms[:hit + 1]), rel=1e-12), spec
    assert summary["none"]["reached"] == 1 and summary["none"]["speedup"] == 1.0
    if summary["powersgd(4)"]["target_s"]:
        assert summary["powersgd(4)"]["speedup"] == pytest.approx(rows["none"]["target_s"] /
                                                                   rows["powersgd(4)"]["target_s"])

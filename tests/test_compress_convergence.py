"""Issue 6's convergence and bytes targets on the example task, as tests.

Runs of ``benchmarks/compression.py --train`` (part B): examples/mlp.toml
(the 32-256-256-10 MLP, 76,810 parameters, on the synthetic teacher task, the
data made as ``make train`` makes it), 1500 steps, 4 ranks under
``mpirun -n 4 --oversubscribe``: ``train.seed`` 0 with none, topk(0.01),
powersgd(4) and sign, seeds 1 and 2 with the first three. "Final loss" is
the benchmark's: the mean training loss of the last 50 steps; the loss
targets compare the mean over seeds 0-2, as a single seed's ratio moves by a
few % (BLAS on another CPU rounds differently, which acts like another seed).

The targets this suite does not meet yet are ``xfail(strict=True)`` with the
numbers measured: they run every time, and the day one is met it XPASSes,
which fails the suite until its marker is removed. Serial test (it launches
its own mpirun); about 90 s on 2 cores.
"""
import json
import math
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SPECS = ["none", "topk(0.01)", "powersgd(4)", "sign"]
SEEDS = {0: SPECS, 1: SPECS[:3], 2: SPECS[:3]}
TARGET_LOSS = 1.02    # final loss within 2 % (relative) of uncompressed
TARGET_BYTES = 30     # at most 1/30 of the uncompressed bytes
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run_bounded(cmd, timeout):
    """``cmd`` in its own process group, killed whole (mpirun and its ranks too) at ``timeout``."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=MPI_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])} ... ran past {timeout} s")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """seed -> spec -> the benchmark's JSON row (final_loss, loss_vs_none, bytes_sent, accuracy, rc)."""
    folder = tmp_path_factory.mktemp("convergence")
    data = {"train": (folder / "synth-train.h5", 65536, 1), "eval": (folder / "synth-eval.h5", 8192, 2)}
    # pytest.fail, not assert, in here: the xfail markers below expect only an AssertionError,
    # so a run that breaks errors every test instead of passing for an expected failure
    for path, n, seed in data.values():  # as the Makefile makes data/synth-*.h5
        rc, _, err = run_bounded([sys.executable, "-m", "hpctrain", "data", "synth", "--out", str(path),
                                  "--n", str(n), "--seed", str(seed)], 60)
        if rc:
            pytest.fail(f"data synth exit {rc}: {err[-2000:]}")
    runs = {}
    for seed, specs in SEEDS.items():
        out = folder / f"convergence-{seed}.json"
        rc, stdout, stderr = run_bounded([sys.executable, "benchmarks/compression.py", "--train",
                                          "--launcher", "mpirun -n 4 --oversubscribe", "--train-compressors",
                                          ",".join(specs), "--set", f'data.train="{data["train"][0]}"',
                                          "--set", f'data.eval="{data["eval"][0]}"', "--set", "train.steps=1500",
                                          "--set", f"train.seed={seed}", "--json", str(out)], 300)
        print(stdout)  # the table, for the log
        if rc:
            pytest.fail(f"benchmark exit {rc}:\n{stdout[-3000:]}{stderr[-3000:]}")
        rows = {r["spec"]: r for r in json.loads(out.read_text())["rows"]}
        if list(rows) != specs or not all(r["rc"] == 0 and r["n_steps"] == 1500 and r["ranks"] == 4
                                          and math.isfinite(r["final_loss"]) and r["bytes_sent"] > 0
                                          for r in rows.values()):
            pytest.fail(f"unexpected runs, seed {seed}: {rows}")
        runs[seed] = rows
    return runs


def loss_vs_none(runs, spec):
    """Final loss of ``spec`` over none's, each the mean over the seeds."""
    mean = {s: sum(runs[seed][s]["final_loss"] for seed in runs) / len(runs) for s in ("none", spec)}
    return mean[spec] / mean["none"]


def test_every_compressor_reaches_the_examples_accuracy(runs):
    # examples/mlp.toml's target_accuracy: chance is ~10 %
    acc = {(seed, s): float(r["accuracy"]) for seed, rows in runs.items() for s, r in rows.items()}
    assert all(a >= 90.0 for a in acc.values()), acc


def test_sign_with_error_feedback_converges(runs):
    # the loss starts at ~ln(10) = 2.3; measured 0.098 after 1500 steps (none 0.066)
    assert runs[0]["sign"]["final_loss"] < 0.15 and runs[0]["sign"]["loss_vs_none"] < 2.0


def test_topk_1pct_sends_at_most_1_30_of_the_bytes(runs):
    # measured 33x at 4 ranks: float32 values, 16-bit block offsets (hpctrain/compress/sparse.py);
    # 100/p x 8/6 = 33.3x at most (1 % kept, 6 bytes each, p - 1 payloads all-gathered)
    assert TARGET_BYTES <= runs[0]["none"]["bytes_sent"] / runs[0]["topk(0.01)"]["bytes_sent"] <= 33.4


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="issue 6, not met: topk(0.01) ends at 1.147x none's final loss "
                                       "(seeds 0-2; 1.139x, 1.194x, 1.108x each); docs/benchmarks.md")
def test_topk_1pct_final_loss_within_2pct_of_uncompressed(runs):
    assert loss_vs_none(runs, "topk(0.01)") <= TARGET_LOSS


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="issue 6, not met: powersgd(4) ends at ~1.03x none's final loss "
                                       "(seeds 0-2; 1.040x, 1.034x, 1.023x each)")
def test_powersgd_rank_4_final_loss_within_2pct_of_uncompressed(runs):
    assert loss_vs_none(runs, "powersgd(4)") <= TARGET_LOSS


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="issue 6, not met: powersgd(4) sends 1/16 on this MLP; its 256x256 "
                                       "layer alone takes 2048 of the 2560 values per step 1/30 allows")
def test_powersgd_rank_4_sends_at_most_1_30_of_the_bytes(runs):
    assert runs[0]["none"]["bytes_sent"] >= TARGET_BYTES * runs[0]["powersgd(4)"]["bytes_sent"]

"""Issue 6's convergence and bytes targets on the example task, as tests.

One run of ``benchmarks/compression.py --train`` (part B): examples/mlp.toml
(the 32-256-256-10 MLP, 76,810 parameters, on the synthetic teacher task, the
data made as ``make train`` makes it), ``train.seed`` 0, 1500 steps, 4 ranks
under ``mpirun -n 4 --oversubscribe``, once each with none, topk(0.01),
powersgd(4) and sign. "Final loss" is the benchmark's: the mean training
loss of the last 50 steps. The runs are deterministic on one machine.

The targets this suite does not meet yet are ``xfail(strict=True)`` with the
numbers measured: they run every time, and the day one is met it XPASSes,
which fails the suite until its marker is removed. Serial test (it launches
its own mpirun); about 40 s on 2 cores.
"""

import json
import math
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SPECS = ["none", "topk(0.01)", "powersgd(4)", "sign"]
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
    """spec -> the benchmark's JSON row for it (final_loss, loss_vs_none, bytes_sent, accuracy, rc)."""
    folder = tmp_path_factory.mktemp("convergence")
    data = {"train": (folder / "synth-train.h5", 65536, 1), "eval": (folder / "synth-eval.h5", 8192, 2)}
    # pytest.fail, not assert, in here: the xfail markers below expect only an AssertionError,
    # so a run that breaks errors every test instead of passing for an expected failure
    for path, n, seed in data.values():  # as the Makefile makes data/synth-*.h5
        rc, _, err = run_bounded([sys.executable, "-m", "hpctrain", "data", "synth", "--out", str(path),
                                  "--n", str(n), "--seed", str(seed)], 60)
        if rc:
            pytest.fail(f"data synth exit {rc}: {err[-2000:]}")
    out = folder / "convergence.json"
    rc, stdout, stderr = run_bounded([sys.executable, "benchmarks/compression.py", "--train",
                                      "--launcher", "mpirun -n 4 --oversubscribe", "--train-compressors",
                                      ",".join(SPECS), "--set", f'data.train="{data["train"][0]}"',
                                      "--set", f'data.eval="{data["eval"][0]}"', "--set", "train.steps=1500",
                                      "--set", "train.seed=0", "--json", str(out)], 720)
    print(stdout)  # the table, for the log
    if rc:
        pytest.fail(f"benchmark exit {rc}:\n{stdout[-3000:]}{stderr[-3000:]}")
    rows = {r["spec"]: r for r in json.loads(out.read_text())["rows"]}
    if list(rows) != SPECS or not all(r["rc"] == 0 and r["n_steps"] == 1500 and r["ranks"] == 4
                                      and math.isfinite(r["final_loss"]) and r["bytes_sent"] > 0
                                      for r in rows.values()):
        pytest.fail(f"unexpected runs: {rows}")
    return rows


def test_every_compressor_reaches_the_examples_accuracy(runs):
    # examples/mlp.toml's target_accuracy: chance is ~10 %
    assert all(float(r["accuracy"]) >= 90.0 for r in runs.values()), {s: r["accuracy"] for s, r in runs.items()}


def test_sign_with_error_feedback_converges(runs):
    # the loss starts at ~ln(10) = 2.3; measured 0.098 after 1500 steps (none 0.066)
    assert runs["sign"]["final_loss"] < 0.15 and runs["sign"]["loss_vs_none"] < 2.0


def test_topk_1pct_sends_at_most_1_30_of_the_bytes(runs):
    # measured 33x at 4 ranks: float32 values, 16-bit block offsets (hpctrain/compress/sparse.py);
    # 100/p x 8/6 = 33.3x at most (1 % kept, 6 bytes each, p - 1 payloads all-gathered)
    assert TARGET_BYTES <= runs["none"]["bytes_sent"] / runs["topk(0.01)"]["bytes_sent"] <= 33.4


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="issue 6, not met: topk(0.01) ends at 1.139x none's final loss "
                                       "(seeds 1-3: 1.194x, 1.108x, 1.154x); docs/benchmarks.md")
def test_topk_1pct_final_loss_within_2pct_of_uncompressed(runs):
    assert runs["topk(0.01)"]["loss_vs_none"] <= TARGET_LOSS


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="issue 6, not met: powersgd(4) ends at 1.040x none's final loss "
                                       "(seeds 1-3: 1.034x, 1.023x, 1.038x)")
def test_powersgd_rank_4_final_loss_within_2pct_of_uncompressed(runs):
    assert runs["powersgd(4)"]["loss_vs_none"] <= TARGET_LOSS


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="issue 6, not met: powersgd(4) sends 1/16 on this MLP; its 256x256 "
                                       "layer alone takes 2048 of the 2560 values per step 1/30 allows")
def test_powersgd_rank_4_sends_at_most_1_30_of_the_bytes(runs):
    assert runs["none"]["bytes_sent"] >= TARGET_BYTES * runs["powersgd(4)"]["bytes_sent"]

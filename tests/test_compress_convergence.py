"""Compression on the example MLP, trained to the end by ``benchmarks/compression.py --train``.

Runs of part B: examples/mlp.toml (the 32-256-256-10 MLP, 76,810 parameters, on the synthetic
teacher task, the data made as ``make train`` makes it), 1500 steps, 2 ranks under
``mpirun -n 2``, ``train.seed`` 0, with none, topk(0.01), powersgd(4) and sign.
"Final loss" is the benchmark's: the mean training loss of the last 50 steps. Two ranks, one per
core: 4 ranks on two cores took 64 s alone against 28 s (164 s in CI beside the other pytest
worker), and the 4-rank sums are the MPI tests' business (tests/test_mpi_compress*.py).

Compression's loss and bytes targets are judged on the GPT (tests/test_compress_gpt_convergence.py,
benchmarks/compression.py --model gpt): on this MLP powersgd(4) cannot send 1/30 of the bytes
(docs/dist.md has the arithmetic) and its final losses (topk 1.147x, powersgd 1.033x of none's,
seeds 0-2, 4 ranks) are recorded in docs/dist.md. Serial test (it launches its own mpirun).
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
SEEDS = {0: SPECS}
TARGET_BYTES = 30     # at most 1/30 of the uncompressed bytes
RANKS = 2
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
    for path, n, seed in data.values():  # as the Makefile makes data/synth-*.h5
        rc, _, err = run_bounded([sys.executable, "-m", "hpctrain", "data", "synth", "--out", str(path),
                                  "--n", str(n), "--seed", str(seed)], 60)
        if rc:
            pytest.fail(f"data synth exit {rc}: {err[-2000:]}")
    runs = {}
    for seed, specs in SEEDS.items():
        out = folder / f"convergence-{seed}.json"
        rc, stdout, stderr = run_bounded([sys.executable, "benchmarks/compression.py", "--train",
                                          "--launcher", f"mpirun -n {RANKS}", "--train-compressors",
                                          ",".join(specs), "--set", f'data.train="{data["train"][0]}"',
                                          "--set", f'data.eval="{data["eval"][0]}"', "--set", "train.steps=1500",
                                          "--set", f"train.seed={seed}", "--json", str(out)], 300)
        print(stdout)  # the table, for the log
        if rc:
            pytest.fail(f"benchmark exit {rc}:\n{stdout[-3000:]}{stderr[-3000:]}")
        rows = {r["spec"]: r for r in json.loads(out.read_text())["rows"]}
        if list(rows) != specs or not all(r["rc"] == 0 and r["n_steps"] == 1500 and r["ranks"] == RANKS
                                          and math.isfinite(r["final_loss"]) and r["bytes_sent"] > 0
                                          for r in rows.values()):
            pytest.fail(f"unexpected runs, seed {seed}: {rows}")
        runs[seed] = rows
    return runs


def test_every_compressor_reaches_the_examples_accuracy(runs):
    # examples/mlp.toml's target_accuracy: chance is ~10 %
    acc = {(seed, s): float(r["accuracy"]) for seed, rows in runs.items() for s, r in rows.items()}
    assert all(a >= 90.0 for a in acc.values()), acc


def test_sign_with_error_feedback_converges(runs):
    # the loss starts at ~ln(10) = 2.3; measured 0.099 after 1500 steps at 2 ranks (none 0.066)
    assert runs[0]["sign"]["final_loss"] < 0.15 and runs[0]["sign"]["loss_vs_none"] < 2.0


def test_topk_1pct_sends_at_most_1_30_of_the_bytes(runs):
    # float32 values, 16-bit block offsets (hpctrain/compress/sparse.py): 1 % kept at 6 bytes each,
    # p - 1 payloads all-gathered, against the ring's 2 (p - 1) / p x 4 bytes per value: at most
    # (8 / p) / 0.06 = 133.3 / p, measured 66.5x at 2 ranks (33.2x at 4). The floor keeps the 4-rank
    # target's slack (1/30 against 1/33.3 there: 0.9 of the closed form), so wider offsets or values
    # (25x at 4 ranks, 50x at 2) fail at any rank count
    ratio = runs[0]["none"]["bytes_sent"] / runs[0]["topk(0.01)"]["bytes_sent"]
    assert max(TARGET_BYTES, 0.9 * 133.3 / RANKS) <= ratio <= 133.4 / RANKS, ratio

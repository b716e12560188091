"""``python -m hpctrain launch``: real mpirun jobs that fail and are restarted from the newest
checkpoint. A kill -9 of one rank mid-run costs a restart, and the run then ends with the bits
of a run resumed from the same checkpoint without the failure; a crash before the first step
restarts once, then gives up; more failures than allowed give up with exit 6; a stalled rank
(the watchdog's exit 4) is a failure like a crash; SIGTERM to the launcher saves and stops
with no restart; a user error is not restarted; benchmarks/recovery.py splits a restart into its
phases. Every launch has a timeout."""

import json
import os
import re
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import REPO
from mpi_jobs import env, finish, rank_pid, wait_for

pytestmark = pytest.mark.timeout(240)

EXIT_GAVE_UP, EXIT_CHECKPOINTED = 6, 75


def _train(data, ckpt, steps, *extra):
    return ["train", "--config", "examples/mlp.toml", "--set", f"data.train={data}", "--set", "data.eval=",
            "--set", "train.metrics=", "--set", "model.hidden=[64]", "--set", "train.global_batch=64",
            "--set", "train.dtype=float64", "--set", "train.target_accuracy=0", "--set", f"train.steps={steps}",
            "--set", "train.log_every=1000000", "--set", f"checkpoint.dir={ckpt}",
            "--set", "checkpoint.every_minutes=0", *extra]


def _launch(args, *launcher_opts, **extra_env):
    return subprocess.Popen([sys.executable, "-m", "hpctrain", "launch", "-n", "2", "--oversubscribe",
                             *launcher_opts, "--", *args], cwd=REPO, env=env(**extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _model(path):
    with h5py.File(path, "r") as f:
        out = {}
        f["model"].visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset)
                              else None)
        return out


def test_kill_9_of_a_rank_restarts_and_ends_as_a_resume_from_the_same_checkpoint(small_data, tmp_path):
    ckpt, steps = str(tmp_path / "ck"), 400
    args = _train(small_data[0], ckpt, steps, "--set", "checkpoint.every_steps=20", "--set", "checkpoint.keep_last=0",
                  "--set", "checkpoint.save_final=true")
    proc = _launch(args)
    try:
        wait_for(lambda: os.path.exists(os.path.join(ckpt, "ckpt-00000040.h5")), 120, "the checkpoint of step 40")
        os.kill(rank_pid(ckpt, 1), signal.SIGKILL)
    finally:
        code, out, err = finish(proc, 180)
    assert code == 0, (out[-3000:], err[-3000:])
    assert "failure 1: exit code 137 (a rank killed by signal 9, SIGKILL)" in out, out
    assert "restart 1 of at most 3" in out and "restart 2" not in out
    recovered = re.search(r"recovered: first new step [\d.]+ s after the failed job ended \(start-up [\d.]+ s, "
                          r"checkpoint load and set-up [\d.]+ s, first step [\d.]+ s\); resumed at step (\d+), "
                          r"(\d+) step\(s\) redone", out)
    assert recovered, out
    resumed = int(recovered.group(1))
    assert resumed >= 40 and resumed % 20 == 0 and f"resumed from {ckpt}/ckpt-{resumed:08d}.h5" in out
    assert "the job finished (after 1 restart(s))" in out and "Traceback" not in err

    # the same checkpoint, resumed by a job that never failed, ends with the same bits
    ref = str(tmp_path / "ref")
    plain = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "hpctrain",
                            *_train(small_data[0], ref, steps, "--set", "checkpoint.save_final=true",
                                    "--resume", os.path.join(ckpt, f"ckpt-{resumed:08d}.h5"))],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    got, want = _model(os.path.join(ckpt, f"ckpt-{steps:08d}.h5")), _model(os.path.join(ref, f"ckpt-{steps:08d}.h5"))
    assert got.keys() == want.keys() and got
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_crash_before_the_first_step_restarts_once_then_gives_up(small_data, tmp_path):
    proc = _launch(_train(small_data[0], str(tmp_path / "ck"), 50), HPCTRAIN_FAULT="segv:start:1")
    code, out, err = finish(proc, 120)
    assert code == EXIT_GAVE_UP, (out, err)
    assert "restart 1 of at most 3" in out and "restart 2" not in out          # from scratch once, not again
    assert len(re.findall(r"failure \d: exit code 139 \(a rank killed by signal 11, SIGSEGV\) before its first step",
                          out)) == 2, out
    errors = [line for line in err.splitlines() if "hpctrain launch: error:" in line]
    assert len(errors) == 1 and "failed twice in a row before completing a step" in errors[0], err


def test_more_failures_than_allowed_give_up_with_exit_6(small_data, tmp_path):
    """A bug at step 3 on rank 1 after a checkpoint at step 2: each start makes progress, so only
    --max-failures ends it."""
    ckpt = str(tmp_path / "ck")
    proc = _launch(_train(small_data[0], ckpt, 50, "--set", "checkpoint.every_steps=2"), "--max-failures", "1",
                   HPCTRAIN_FAULT="raise:3:1")
    code, out, err = finish(proc, 120)
    assert code == EXIT_GAVE_UP, (out, err)
    assert "failure 1: exit code" in out and "failure 2: exit code" in out and "restart 2" not in out, out
    assert "resumed at step 2, 1 step(s) redone" in out, out
    errors = [line for line in err.splitlines() if "hpctrain launch: error:" in line]
    assert len(errors) == 1 and "2 failure(s), more than --max-failures=1" in errors[0], err


@pytest.mark.exclusive  # the watchdog's limit of 3 s
def test_a_stalled_rank_is_a_failure_that_restarts(small_data, tmp_path):
    proc = _launch(_train(small_data[0], str(tmp_path / "ck"), 50, "--set", "checkpoint.every_steps=2",
                          "--set", "dist.comm_timeout=3"), "--max-failures", "1", HPCTRAIN_FAULT="hang:5:1")
    code, out, err = finish(proc, 150)
    assert code == EXIT_GAVE_UP, (out, err)
    assert out.count("exit code 4 (the stall watchdog ended a stalled job)") == 2, out
    assert "restart 1 of at most 1" in out and "resumed at step 4" in out, out


def test_sigterm_to_the_launcher_saves_and_stops_without_a_restart(small_data, tmp_path):
    ckpt = str(tmp_path / "ck")
    proc = _launch(_train(small_data[0], ckpt, 10**6, "--set", "checkpoint.every_steps=5",
                          "--set", "checkpoint.keep_last=1"))
    try:
        wait_for(lambda: os.path.isdir(ckpt) and any(n.startswith("ckpt-") for n in os.listdir(ckpt)), 120,
                 "the first checkpoint")
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        code, out, err = finish(proc, 120)
    assert code == EXIT_CHECKPOINTED, (out, err)
    assert "got SIGTERM: passing SIGUSR1 to the job" in out and "stopping at step" in out, out
    assert "restart 1" not in out and "no restart" in out, out


def test_a_user_error_is_not_restarted(small_data, tmp_path):
    proc = _launch(_train(small_data[0], str(tmp_path / "ck"), 5, "--set", "train.stepz=5"))
    code, out, err = finish(proc, 120)
    assert code == 2 and "unknown key train.stepz" in err and "restart 1" not in out, (out, err)


@pytest.mark.parametrize("argv, fragment", [
    (["launch", "-n", "2", "train"], "expected '-- train ARGS'"),
    (["launch", "--", "train"], "-n N (the number of ranks, >= 1) is required"),
    (["launch", "-n", "2", "--", "sample"], "must be 'train ...'"),
    (["launch", "-n", "two", "--", "train"], "-n needs a whole number"),
])
def test_launch_usage_errors(argv, fragment):
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_resume_auto_replaces_the_users_resume():
    from hpctrain.reliability.launch import with_resume_auto

    assert with_resume_auto(["train", "--resume", "x.h5", "--set", "a=1"]) == ["train", "--set", "a=1", "--resume",
                                                                               "auto"]
    assert with_resume_auto(["train", "--resume=x.h5"]) == ["train", "--resume", "auto"]


def test_recovery_benchmark_splits_a_restart_into_its_phases(small_data, tmp_path):
    """benchmarks/recovery.py on the MLP: one kill -9, one restart, one row with every phase measured."""
    out = tmp_path / "recovery.json"
    proc = subprocess.run([sys.executable, "benchmarks/recovery.py", "--models", "mlp", "--every", "5", "--kill-at",
                           "10", "--mlp-data", small_data[0], "--json", str(out), "--timeout", "150"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    (row,) = json.load(open(out))["rows"]
    assert row["model"] == "mlp" and row["ranks"] == 2 and row["resumed_at"] >= 10, row
    assert row["detect_s"] > 0 and row["startup_s"] > 0 and row["first_step_s"] > 0, row
    assert "| mlp | 2 |" in proc.stdout, proc.stdout

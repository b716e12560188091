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
import time

import h5py
import numpy as np
import pytest

from conftest import REPO
from mpi_jobs import alive, env, finish, rank_pid, rank_pids, wait_for

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


def _records(path):
    return [json.loads(line) for line in open(path)]


def test_kill_9_of_a_rank_restarts_and_ends_as_a_run_that_never_failed(small_data, tmp_path):
    """Rank 0 (the one that writes the metrics) killed after a checkpoint: the job restarts from it
    and ends with the bits of a run that never failed, and its metrics file holds every step once,
    each record's loss, accuracy and learning rate those of that run (the records before the
    checkpoint were on disk, the ones the failed attempt wrote after it are replaced)."""
    ckpt, steps, metrics = str(tmp_path / "ck"), 400, str(tmp_path / "metrics.jsonl")
    args = _train(small_data[0], ckpt, steps, "--set", "checkpoint.every_steps=20", "--set", "checkpoint.keep_last=0",
                  "--set", "checkpoint.save_final=true", "--set", f"train.metrics={metrics}")
    # paced (the arithmetic unchanged): the 360 steps after the checkpoint of step 40 take seconds,
    # not the 2 s the whole run takes unpaced, so the kill lands while the run trains
    proc = _launch(args, HPCTRAIN_STEP_DELAY_S="0.01")
    try:
        wait_for(lambda: os.path.exists(os.path.join(ckpt, "ckpt-00000040.h5")), 120, "the checkpoint of step 40")
        os.kill(rank_pid(ckpt, 0), signal.SIGKILL)
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

    # a run that never failed (a resume is bit-exact, so this is also a plain resume's end): the same
    # final bits, and the same metrics record by record
    straight, whole = str(tmp_path / "straight"), str(tmp_path / "whole.jsonl")
    plain = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "hpctrain",
                            *_train(small_data[0], straight, steps, "--set", "checkpoint.save_final=true",
                                    "--set", f"train.metrics={whole}")],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    final = f"ckpt-{steps:08d}.h5"
    got, want = _model(os.path.join(ckpt, final)), _model(os.path.join(straight, final))
    assert got.keys() == want.keys() and got
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    records, expected = _records(metrics), _records(whole)
    assert [r["step"] for r in records] == list(range(1, steps + 1)) == [r["step"] for r in expected]
    for r, e in zip(records, expected):
        assert (r["loss"], r["accuracy"], r["lr"]) == (e["loss"], e["accuracy"], e["lr"]), (r, e)


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


@pytest.mark.exclusive  # a heartbeat limit of 3 s
def test_a_stopped_rank_is_heard_gone_in_seconds_and_the_job_restarts(small_data, tmp_path):
    """Rank 1 stopped (SIGSTOP: what a rank on a node that lost power or its network looks like to
    the others) under dist.comm_timeout's default of 300 s: its heartbeats stop, the launcher ends
    the job after HPCTRAIN_DETECT_S = 3 s (the stopped rank too: nothing is left behind), restarts
    it from the newest checkpoint, and the run finishes; the first new step comes within 30 s of the
    stop, where the watchdog alone would have waited 300 s. Its node's other rank still beat, so the
    cause is the rank, not the node."""
    ckpt, steps = str(tmp_path / "ck"), 200
    args = _train(small_data[0], ckpt, steps, "--set", "checkpoint.every_steps=20", "--set", "checkpoint.keep_last=0")
    # paced: the stop lands while the run trains (unpaced, 200 steps take about 1 s: a stop after
    # the run said it was over is another case, the next test's)
    proc = _launch(args, HPCTRAIN_DETECT_S="3", HPCTRAIN_STEP_DELAY_S="0.03")
    stopped = None
    try:
        wait_for(lambda: os.path.exists(os.path.join(ckpt, "ckpt-00000040.h5")), 120, "the checkpoint of step 40")
        stopped = rank_pid(ckpt, 1)
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.time()
        code, out, err = finish(proc, 120)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:  # the launcher, mpirun and the ranks: one session
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, (out[-3000:], err[-3000:])
    assert "rank(s) 1 stopped answering (silent for" in out and "their nodes' other ranks still beat" in out, out
    assert "failure 1: rank(s) 1 stopped answering" in out and "the job finished (after 1 restart(s))" in out, out
    assert not alive([stopped]), "the stopped rank was left behind"
    m = re.search(r"recovered: first new step ([\d.]+) s after the failure \(detection ([\d.]+) s, tear-down "
                  r"([\d.]+) s, start-up [\d.]+ s, checkpoint load and set-up [\d.]+ s, first step [\d.]+ s\); "
                  r"resumed at step (\d+)", out)
    assert m, out
    total, detection = float(m.group(1)), float(m.group(2))
    assert 3.0 <= detection < 6.0, out    # the limit, and at most a beat and a poll more
    assert total < 30.0 and int(m.group(4)) >= 40, out
    print(f"\nstopped rank: detection {detection:.1f} s, first new step {total:.1f} s after the failure "
          f"(the stop at {t_stop:.1f})")


@pytest.mark.exclusive  # an exit grace of 2 s
@pytest.mark.parametrize("end", ["diverged", "stopped"])
def test_a_rank_stuck_in_its_exit_is_ended_with_the_runs_exit_code(small_data, tmp_path, end):
    """Rank 1 hangs after its run is over (its last heartbeat said so, with its exit code; rank 0
    waits for it in MPI_Finalize): 2 s (HPCTRAIN_EXIT_GRACE_S) after the last rank said its run was
    over the launcher ends the job and exits with the code the ranks said, not the tear-down's,
    restarting nothing; no rank is left behind. Two ends: a run that raised on every rank (a NaN
    at step 5 under guard.nonfinite = abort: exit 5), and a run that saved and stopped after
    SIGTERM reached the launcher (exit 75; the launcher reads the heartbeats after a stop too)."""
    ckpt = str(tmp_path / "ck")
    fault = "nan:5:0,hang:exit:1" if end == "diverged" else "hang:exit:1"
    proc = _launch(_train(small_data[0], ckpt, 20 if end == "diverged" else 10**6, "--set", "checkpoint.every_steps=5"),
                   HPCTRAIN_FAULT=fault, HPCTRAIN_EXIT_GRACE_S="2")
    try:
        if end == "stopped":
            wait_for(lambda: os.path.isdir(ckpt) and any(n.startswith("ckpt-") for n in os.listdir(ckpt)), 120,
                     "the first checkpoint")
            os.kill(proc.pid, signal.SIGTERM)
        code, out, err = finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    want = 5 if end == "diverged" else EXIT_CHECKPOINTED
    assert code == want, (out[-3000:], err[-3000:])
    assert (f"every rank's run was over (rank(s) 0, 1 said so; exit code {want}) but the job had not ended 2 s "
            f"later" in out), out
    assert "failure" not in out and "restart" not in out.replace("so no restart", ""), out
    wait_for(lambda: rank_pids(ckpt) == [], 10, "every rank to be gone")


def test_a_rank_crashing_in_its_exit_after_its_run_ends_the_job_with_the_runs_code(small_data, tmp_path):
    """Rank 1 crashes (SIGSEGV) after every rank said its run was over (exit 0): mpirun reports
    the crash, but nothing is lost and nothing restarts: the launcher exits 0 and says why."""
    proc = _launch(_train(small_data[0], str(tmp_path / "ck"), 20), HPCTRAIN_FAULT="segv:exit:1")
    code, out, err = finish(proc, 120)
    assert code == 0, (out[-3000:], err[-3000:])
    assert re.search(r"the job ended with exit code 139 \(a rank killed by signal 11, SIGSEGV\) after every "
                     r"rank's run was over \(exit code 0\): taking 0", out), out
    assert "the job finished" in out and "failure" not in out and "restart" not in out, out


@pytest.mark.exclusive  # a heartbeat limit of 3 s, on a node kept busy
def test_busy_ranks_on_an_oversubscribed_node_keep_beating(small_data, tmp_path):
    """Four ranks of a wider MLP on this 2-core machine, every core busy for about 15 s, under a
    heartbeat limit of 3 s (the default is 10): no rank is taken for lost, and the launcher reports
    the largest gap between two beats of a rank (a beat a second is sent; here it stays far below
    the limit)."""
    args = _train(small_data[0], str(tmp_path / "ck"), 100000, "--set", "model.hidden=[512,512]",
                  "--set", "train.global_batch=256")
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "launch", "-n", "4", "--oversubscribe", "--", *args],
                            cwd=REPO, env=env(HPCTRAIN_DETECT_S="3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        time.sleep(15)
        os.kill(proc.pid, signal.SIGTERM)  # save and stop (exit 75)
        code, out, err = finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == EXIT_CHECKPOINTED, (out[-3000:], err[-3000:])
    assert "stopped answering" not in out and "failure" not in out, out
    gap = float(re.search(r"heartbeats: the largest gap between two beats of a rank was ([\d.]+) s", out).group(1))
    assert gap < 3.0, out
    print(f"\nbusy node: the largest gap between two beats of a rank {gap:.1f} s")


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
    proc = subprocess.run([sys.executable, "benchmarks/recovery.py", "--cases", "rank", "--models", "mlp",
                           "--every", "5", "--kill-at", "10", "--mlp-data", small_data[0], "--json", str(out),
                           "--timeout", "150"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    (row,) = json.load(open(out))["rows"]
    assert row["case"] == "rank" and row["model"] == "mlp" and row["ranks"] == 2 and row["resumed_at"] >= 10, row
    assert row["detect_s"] > 0 and row["startup_s"] > 0 and row["load_s"] > 0 and row["first_step_s"] > 0, row
    assert row["total_s"] >= row["detect_s"] + row["startup_s"] and row["total_by_clock_s"] > 0, row
    assert "| rank | mlp | 2 |" in proc.stdout and "failure 1: exit code 137" in proc.stdout, proc.stdout


def test_a_pipeline_stage_killed_mid_step_restarts_from_the_logical_checkpoint(text_data, tmp_path):
    """dist.pipeline_parallel = 2: the last stage (rank 1) killed -9 while the first waits for its
    gradients. The job ends and launch restarts it from the newest checkpoint (every stage's arrays in
    one logical file); it ends with the bits of a plain resume from that checkpoint."""
    ckpt, steps = str(tmp_path / "ck"), 60
    args = ["train", "--config", "examples/gpt.toml", "--set", f"data.train={text_data}", "--set", "train.metrics=",
            "--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "model.context=32",
            "--set", "train.global_batch=8", "--set", "train.grad_accum_steps=4", "--set", "train.device=cpu",
            "--set", "train.target_val_bpb=0", "--set", "train.target_bpb_vs_bigram=0", "--set", "train.eval_tokens=0",
            "--set", f"train.steps={steps}", "--set", "train.log_every=1000000", "--set", "dist.pipeline_parallel=2",
            "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_minutes=0", "--set",
            "checkpoint.every_steps=10", "--set", "checkpoint.keep_last=0", "--set", "checkpoint.save_final=true"]
    proc = _launch(args, HPCTRAIN_STEP_DELAY_S="0.05")
    try:
        wait_for(lambda: os.path.exists(os.path.join(ckpt, "ckpt-00000020.h5")), 120, "the checkpoint of step 20")
        os.kill(rank_pid(ckpt, 1), signal.SIGKILL)
    finally:
        code, out, err = finish(proc, 200)
    assert code == 0, (out[-3000:], err[-3000:])
    assert "failure 1: exit code 137 (a rank killed by signal 9, SIGKILL)" in out, out
    resumed = int(re.search(r"resumed at step (\d+)", out).group(1))
    assert resumed >= 20 and resumed % 10 == 0, out
    ref = str(tmp_path / "ref")
    plain = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "hpctrain",
                            *[a.replace(ckpt, ref) for a in args],
                            "--resume", os.path.join(ckpt, f"ckpt-{resumed:08d}.h5")],
                           cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    got, want = _model(os.path.join(ckpt, f"ckpt-{steps:08d}.h5")), _model(os.path.join(ref, f"ckpt-{steps:08d}.h5"))
    assert got.keys() == want.keys() and "h/1/mlp/c_fc/weight" in got
    for name in got:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

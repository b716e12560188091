"""Faults in a running job, from outside as a user meets them: kill -9 of one rank,
SIGSTOP of one rank (the stall watchdog), a rank busy elsewhere, an exception on
one rank, kill -9 of one rank during a save, one rank stopped (a lost node) inside a save. Real mpirun jobs; every launch and
every wait has a timeout, and leftover ranks are killed."""

import os
import signal
import time
import uuid

import pytest

from mpi_jobs import alive, ckpt_command, finish, kill_ranks, metrics_steps, rank_pid, rank_pids, start, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.exclusive]  # watchdog limits of 2-4 s

EXIT_STALLED = 4


def _train(data, tmp_path, *extra, steps=1_000_000, marker=None):
    """A long run (by default it never ends by itself) with metrics; its checkpoint.dir is a unique
    marker in its command line, by which the test finds its ranks."""
    marker = marker or str(tmp_path / f"ck-{uuid.uuid4().hex[:8]}")
    args = ["-m", "hpctrain", "train", "--set", f"data.train={data}", "--set", "model.hidden=[64]",
            "--set", "train.global_batch=63", "--set", f"train.steps={steps}", "--set", "train.log_every=1000000",
            "--set", f"train.metrics={tmp_path / 'metrics.jsonl'}", "--set", f"checkpoint.dir={marker}",
            "--set", "checkpoint.every_minutes=0", *extra]
    return marker, args


def test_kill_9_one_rank_mid_training_ends_every_rank(small_data, tmp_path):
    marker, args = _train(small_data[0], tmp_path)
    proc = start(3, args)
    try:
        wait_for(lambda: metrics_steps(tmp_path / "metrics.jsonl") >= 20, 90, "20 training steps")
        pids = rank_pids(marker)
        assert len(pids) == 3, pids
        os.kill(rank_pid(marker, 1), signal.SIGKILL)
        t0 = time.monotonic()
        code, out, err = finish(proc, timeout=60)
        gone_after = time.monotonic() - t0
        wait_for(lambda: not alive(pids), 10, "every rank to be reaped")
    finally:
        kill_ranks(marker)
    assert code != 0
    assert gone_after < 60, gone_after
    # the launcher names the rank that died and how
    assert "rank 1" in err and ("signal 9" in err or "Killed" in err), err[-2000:]


@pytest.mark.parametrize("victim", [1, 0])
def test_sigstop_one_rank_fires_the_watchdog_with_a_diagnostic(small_data, tmp_path, victim):
    marker, args = _train(small_data[0], tmp_path, "--set", "dist.comm_timeout=4")
    proc = start(3, args)
    stopped = None
    try:
        wait_for(lambda: metrics_steps(tmp_path / "metrics.jsonl") >= 20, 90, "20 training steps")
        stopped = rank_pid(marker, victim)
        os.kill(stopped, signal.SIGSTOP)
        code, out, err = finish(proc, timeout=90)
    finally:
        if stopped:
            try:
                os.kill(stopped, signal.SIGCONT)
            except OSError:
                pass
        kill_ranks(marker)
    assert code == EXIT_STALLED, (code, err[-3000:])
    report = [line for line in err.splitlines() if "] hpctrain: watchdog:" in line]
    assert len(report) == 1, err[-3000:]  # reported once, by one rank
    assert "has not completed after" in report[0] and "dist.comm_timeout" in report[0]
    assert "step " in report[0]  # which collective, at which step (and bucket, for gradient all-reduces)
    # the other two wait in the collective the victim never joined, or one of them got its data from
    # the other and already waits in the next one: each is named, either way
    a, b = sorted({0, 1, 2} - {victim})
    waiting = [line for line in err.splitlines() if "waiting in it: " in line][0]
    elsewhere = [line for line in err.splitlines() if ": elsewhere, in " in line]
    assert waiting.endswith(f"ranks {a}, {b}") or (len(elsewhere) == 1 and f"rank {a}" in waiting + elsewhere[0]
                                                    and f"rank {b}" in waiting + elsewhere[0]), err[-3000:]
    assert f"from rank {victim}: stopped (SIGSTOP" in err, err[-3000:]


def test_sigterm_while_a_peer_is_gone_ends_the_job_at_once(small_data, tmp_path):
    """srun --kill-on-bad-exit answers a dead rank with SIGTERM to the others, which sit in a
    collective where Python cannot run their handler; without help they wait for SLURM's KillWait
    (30 s) or dist.comm_timeout (here 300 s). The watchdog thread sees the SIGTERM, finds a rank
    that does not answer (here: stopped) and ends the job within seconds."""
    marker, args = _train(small_data[0], tmp_path, "--set", "dist.comm_timeout=300")
    proc = start(3, args)
    stopped = None
    try:
        wait_for(lambda: metrics_steps(tmp_path / "metrics.jsonl") >= 20, 90, "20 training steps")
        stopped = rank_pid(marker, 2)
        os.kill(stopped, signal.SIGSTOP)
        time.sleep(1.0)   # ranks 0 and 1 now wait for rank 2 in a collective
        t0 = time.monotonic()
        for rank in (0, 1):
            os.kill(rank_pid(marker, rank), signal.SIGTERM)
        code, out, err = finish(proc, timeout=60)
        ended_after = time.monotonic() - t0
    finally:
        if stopped:
            try:
                os.kill(stopped, signal.SIGCONT)
            except OSError:
                pass
        kill_ranks(marker)
    assert code == EXIT_STALLED, (code, err[-3000:])
    assert ended_after < 20, ended_after   # SIGNAL_GRACE (3 s) + the answers' grace (10 s at most) + abort
    report = [line for line in err.splitlines() if "] hpctrain: watchdog:" in line]
    assert len(report) == 1, err[-3000:]
    assert "from rank 2: stopped (SIGSTOP" in err and "SIGTERM arrived" in err, err[-3000:]


def _injected(data, tmp_path, fault, *extra):
    """A 3-rank job of 200 steps with HPCTRAIN_FAULT=fault, run to its end: (exit code, stdout, stderr)."""
    marker, args = _train(data, tmp_path, *extra, steps=200)
    proc = start(3, args, HPCTRAIN_FAULT=fault)
    try:
        return finish(proc, timeout=90)
    finally:
        kill_ranks(marker)


def test_a_rank_busy_elsewhere_is_named_by_the_watchdog(small_data, tmp_path):
    code, out, err = _injected(small_data[0], tmp_path, "hang:30:2", "--set", "dist.comm_timeout=3")
    assert code == EXIT_STALLED, (code, err[-3000:])
    assert err.count("] hpctrain: watchdog:") == 1, err[-3000:]
    assert "gradient all-reduce (bucket 1 of 1" in err and "step 30)" in err, err[-3000:]
    assert "waiting in it: ranks 0, 1" in err
    assert "rank 2: not in a collective" in err, err[-3000:]


def test_a_rank_stuck_during_start_up_fires_the_watchdog(small_data, tmp_path):
    """Start-up collectives are watched too, at 10x dist.comm_timeout: rank 2 hangs before its
    first one, the others wait in the agreement on the data and bucket layout."""
    # dist.comm_timeout = 1: start-up's limit is 10 s (the report comes then: rank 2 answers, busy)
    code, out, err = _injected(small_data[0], tmp_path, "hang:start:2", "--set", "dist.comm_timeout=1")
    assert code == EXIT_STALLED, (code, err[-3000:])
    assert err.count("] hpctrain: watchdog:") == 1, err[-3000:]
    assert "start-up (checking the data and the bucket layout on every rank) has not completed" in err, err[-3000:]
    assert "(limit 10 s: dist.comm_timeout" in err, err[-3000:]
    assert "waiting in it: ranks 0, 1" in err, err[-3000:]
    assert "rank 2: not in a collective; in none yet" in err, err[-3000:]


def test_an_exception_on_one_rank_during_start_up_is_reported_once(small_data, tmp_path):
    code, out, err = _injected(small_data[0], tmp_path, "raise:start:1")
    assert code != 0
    assert err.count("RuntimeError: injected fault at start-up") == 1, err[-3000:]
    assert "[rank 1]" in err and "aborting all 3 ranks" in err


def test_an_exception_on_one_rank_is_reported_once_and_ends_the_job(small_data, tmp_path):
    code, out, err = _injected(small_data[0], tmp_path, "raise:15:1")
    assert code != 0
    assert err.count("RuntimeError: injected fault at step 15") == 1, err[-3000:]
    assert "[rank 1]" in err and "aborting all 3 ranks" in err


def test_a_crash_in_native_code_on_one_rank_ends_the_job(small_data, tmp_path):
    code, out, err = _injected(small_data[0], tmp_path, "segv:15:2")
    assert code != 0
    assert err.count("Fatal Python error: Segmentation fault") == 1, err[-3000:]  # faulthandler: where
    assert "in before_step" in err                                                # (the Python stack)
    assert "rank 2" in err and "signal 11" in err, err[-3000:]                    # mpirun: which rank, what


def test_kill_9_of_one_rank_during_a_save_keeps_the_previous_checkpoint(small_data, tmp_path):
    marker, args = _train(small_data[0], tmp_path, "--set", "checkpoint.every_steps=5", "--set",
                          "train.global_batch=64", steps=200)
    proc = start(2, args, HPCTRAIN_CKPT_WRITE_DELAY_S="60", HPCTRAIN_CKPT_DELAY_STEP="10")
    try:
        wait_for(lambda: os.path.exists(os.path.join(marker, ".ckpt-00000010.h5.tmp")), 90, "the save of step 10")
        time.sleep(0.5)
        os.kill(rank_pid(marker, 1), signal.SIGKILL)  # one rank only: the other is inside the collective save
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_ranks(marker)
    assert code != 0
    names = sorted(n for n in os.listdir(marker) if not n.startswith("."))
    assert names == ["ckpt-00000005.h5"], names
    assert ckpt_command("verify", os.path.join(marker, "ckpt-00000005.h5")).returncode == 0
    resumed = start(2, _train(small_data[0], tmp_path, "--set", "train.global_batch=64", "--resume", "auto",
                              steps=7, marker=marker)[1])
    code, out, err = finish(resumed, timeout=120)
    assert code == 0, err[-3000:]
    assert f"resumed from {marker}/ckpt-00000005.h5 at step 5" in out, out



@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "background"])
def test_a_rank_lost_inside_a_save_fires_the_watchdog_from_inside_hdf5(small_data, tmp_path, background):
    """Rank 1 stops (a lost node) in the middle of the save of step 10, after the data and before
    HDF5's collective close; rank 0 waits for it inside h5py's MPI-IO calls. Those release the GIL
    (checked here: were they to hold it, the watchdog's thread could not run and the job would hang
    until its time limit), so the watchdog asks the others once the plain limit (1 s) has passed,
    hears nothing from rank 1 within the grace (1 s), twice, and ends the job then, not at the
    save's limit (10 x dist.comm_timeout); the previous checkpoint stays the newest. A save in the
    background (checkpoint.async_save): rank 0's training thread goes on until its next collective
    with rank 1 (a step's, or the next save waiting for this one), where the watchdog finds rank 1
    silent; its report says the background save is still in flight."""
    marker, args = _train(small_data[0], tmp_path, "--set", "checkpoint.every_steps=5", "--set",
                          "train.global_batch=64", "--set", "dist.comm_timeout=1", "--set",
                          f"checkpoint.async_save={str(background).lower()}", steps=200)
    proc = start(2, args, HPCTRAIN_CKPT_STOP_RANK="1", HPCTRAIN_CKPT_DELAY_STEP="10")
    try:
        wait_for(lambda: os.path.exists(os.path.join(marker, ".ckpt-00000010.h5.tmp")), 90, "the save of step 10")
        t0 = time.monotonic()
        code, out, err = finish(proc, timeout=60)
        ended_after = time.monotonic() - t0
    finally:
        kill_ranks(marker)
    assert code != 0
    report = [line for line in err.splitlines() if line.startswith("[rank 0] hpctrain: watchdog:")]
    assert report, err[-3000:]
    if background:
        assert "meanwhile this rank's checkpoint save (step 10, in the background) has run for" in err, err[-3000:]
    else:
        assert "checkpoint save (step 10) has not completed after" in report[0], err[-3000:]
        assert "(limit 10 s: dist.comm_timeout)" in report[0], err[-3000:]
        assert "rank 1 did not answer within 1 s, and checkpoint save cannot complete without it" in err, err[-3000:]
    assert "from rank 1: stopped (SIGSTOP" in err, err[-3000:]
    waited = float(report[0].split("has not completed after ")[1].split(" s")[0])
    assert waited < 6, report[0]
    assert ended_after < 20, ended_after
    names = sorted(n for n in os.listdir(marker) if not n.startswith("."))
    assert names == ["ckpt-00000005.h5"], names

"""Background saves (``checkpoint.async_save``) in real mpirun jobs, from outside as a user meets
them: kill -9 of one rank while a background write is held before its commit, and a stop signal
while one is in flight. Every launch and wait has a timeout; leftover ranks are killed."""

import os
import signal

import pytest

from mpi_jobs import ckpt_command, finish, kill_ranks, rank_pid, start, wait_for

pytestmark = pytest.mark.timeout(180)

EXIT_CHECKPOINTED = 75


def _args(data, marker, steps, *extra):
    return ["-m", "hpctrain", "train", "--set", f"data.train={data}", "--set", "model.hidden=[64]",
            "--set", "train.global_batch=64", "--set", f"train.steps={steps}", "--set", "train.log_every=1000000",
            "--set", "train.metrics=", "--set", f"checkpoint.dir={marker}", "--set", "checkpoint.every_minutes=0",
            "--set", "checkpoint.every_steps=5", "--set", "checkpoint.keep_last=0",
            "--set", "checkpoint.async_save=true", *extra]


def _names(marker):
    return sorted(n for n in os.listdir(marker) if not n.startswith("."))


def test_kill_9_during_a_background_write_resumes_from_the_checkpoint_before(small_data, tmp_path):
    """The write of step 10 waits 60 s before its commit while training goes on; rank 1 is killed:
    the job ends, step 5's file is the newest valid one, and the next run resumes from it (removing
    the leftover temporary file) and finishes."""
    marker = str(tmp_path / "ck")
    proc = start(2, _args(small_data[0], marker, 10**6), HPCTRAIN_CKPT_WRITE_DELAY_S="60",
                 HPCTRAIN_CKPT_DELAY_STEP="10")
    try:
        wait_for(lambda: os.path.exists(os.path.join(marker, ".ckpt-00000010.h5.tmp")), 90, "the save of step 10")
        os.kill(rank_pid(marker, 1), signal.SIGKILL)
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_ranks(marker)
    assert code != 0
    assert _names(marker) == ["ckpt-00000005.h5"], _names(marker)
    resumed = start(2, _args(small_data[0], marker, 8, "--resume", "auto"))
    code, out, err = finish(resumed, timeout=120)
    assert code == 0, err[-3000:]
    assert f"resumed from {marker}/ckpt-00000005.h5 at step 5" in out, out
    assert "left by an interrupted save" in out, out
    assert not [n for n in os.listdir(marker) if n.startswith(".")]


def test_a_stop_signal_during_a_background_write_commits_it_then_saves_and_exits_75(small_data, tmp_path):
    """SIGUSR1 while step 10's background write is held 3 s before its commit: the signal's save
    waits for it, then writes its own step; both verify, and the run exits 75."""
    marker = str(tmp_path / "ck")
    proc = start(2, _args(small_data[0], marker, 10**6), HPCTRAIN_CKPT_WRITE_DELAY_S="3",
                 HPCTRAIN_CKPT_DELAY_STEP="10")
    try:
        wait_for(lambda: os.path.exists(os.path.join(marker, ".ckpt-00000010.h5.tmp")), 90, "the save of step 10")
        os.kill(rank_pid(marker, 1), signal.SIGUSR1)
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_ranks(marker)
    assert code == EXIT_CHECKPOINTED, (code, err[-3000:])
    stopped_at = int(out.split("stopping at step ")[1].split(":")[0])
    assert stopped_at > 10, out
    assert "ckpt-00000010.h5" in _names(marker) and f"ckpt-{stopped_at:08d}.h5" in _names(marker), _names(marker)
    listing = ckpt_command("ls", marker, "--verify")
    assert listing.returncode == 0 and listing.stdout.count("verified") >= 3, listing.stdout
    assert "in the background" in out, out

"""Checkpoints as a user's job meets them: real mpirun jobs that are signalled or
killed, then resumed; and the ``ckpt`` command line. Every launch has a timeout. A resume from
a missing file and an unwritable checkpoint.dir, set-up errors agreed by every rank, run the
trainer's set-up in this process (test_cli._one_error_in_process names the real launches of that
mechanism; test_bad_inputs.py holds the real launch of a checkpoint that cannot be loaded)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from test_cli import _one_error_in_process, _train_setup, train_in_process

pytestmark = pytest.mark.timeout(240)

EXIT_CHECKPOINTED = 75


def _train_args(data, ckpt_dir, steps, *extra):
    return ["-m", "hpctrain", "train", "--config", "examples/mlp.toml",
            "--set", f"data.train={data}", "--set", "data.eval=", "--set", "train.metrics=",
            "--set", "model.hidden=[64]", "--set", "train.global_batch=64", "--set", "train.target_accuracy=0",
            "--set", f"train.steps={steps}", "--set", "train.log_every=1000000",
            "--set", f"checkpoint.dir={ckpt_dir}", *extra]


from mpi_jobs import ckpt_command as _ckpt  # noqa: E402
from mpi_jobs import env as _env  # noqa: E402
from mpi_jobs import finish as _finish  # noqa: E402
from mpi_jobs import rank_pids as _rank_pids  # noqa: E402
from mpi_jobs import start as _start  # noqa: E402
from mpi_jobs import wait_for as _wait_for  # noqa: E402


@pytest.mark.parametrize("signame,target", [("SIGUSR1", "rank"), ("SIGTERM", "rank"), ("SIGUSR1", "mpirun")])
def test_signal_to_one_rank_saves_and_exits_75_then_resumes(small_data, tmp_path, signame, target):
    """SIGUSR1/SIGTERM to one rank's pid (as srun or a scheduler delivers), or SIGUSR1 to
    mpirun, which forwards it to every rank (mpirun turns SIGTERM into a kill: docs)."""
    ckpt = str(tmp_path / "ck")
    # every_steps=2: wait for the first checkpoint, so the ranks are surely in the loop
    proc = _start(2, _train_args(small_data[0], ckpt, 10**6, "--set", "checkpoint.every_steps=2",
                                 "--set", "checkpoint.keep_last=1"))
    try:
        _wait_for(lambda: any(n.startswith("ckpt-") for n in os.listdir(ckpt)) if os.path.isdir(ckpt) else False,
                  90, "the first checkpoint")
        pids = _rank_pids(ckpt)
        assert len(pids) == 2, pids
        os.kill(pids[1] if target == "rank" else proc.pid, getattr(signal, signame))
    finally:
        code, out, err = _finish(proc)
    assert code == EXIT_CHECKPOINTED, (code, out, err)
    # mpirun forwards the signal to each rank in turn, and the ranks count who has it at
    # the step's statistics all-reduce, so the two deliveries may straddle one (seen once
    # in CI: "received on 1 rank(s)", then the stop); a signal to one rank's pid is 1
    ranks = ("1",) if target == "rank" else ("1", "2")
    assert out.count("stopping at step") == 1, out
    assert any(f"{signame} received on {n} rank(s)" in out for n in ranks), out
    assert "Traceback" not in err, err
    listing = _ckpt("ls", ckpt, "--verify")
    assert listing.returncode == 0 and "verified" in listing.stdout, listing.stdout
    stopped_at = int(out.split("stopping at step ")[1].split(":")[0])
    assert f"ckpt-{stopped_at:08d}.h5" in listing.stdout  # the save at the signal is the newest

    # the requeued job: resume and finish a few steps later
    done = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable,
                           *_train_args(small_data[0], ckpt, stopped_at + 3, "--resume", "auto")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {ckpt}/ckpt-{stopped_at:08d}.h5 at step {stopped_at}" in done.stdout
    assert f"done: {stopped_at + 3} steps" in done.stdout


def test_kill_9_during_a_save_leaves_the_previous_checkpoint(small_data, tmp_path):
    ckpt = str(tmp_path / "ck")
    # step 4 saves normally; the save of step 8 sleeps 60 s before its commit, and is killed there
    proc = _start(2, _train_args(small_data[0], ckpt, 100, "--set", "checkpoint.every_steps=4"),
                  HPCTRAIN_CKPT_WRITE_DELAY_S="60", HPCTRAIN_CKPT_DELAY_STEP="8")
    try:
        _wait_for(lambda: os.path.exists(os.path.join(ckpt, ".ckpt-00000008.h5.tmp")), 90, "the save of step 8")
        time.sleep(0.5)
        for pid in _rank_pids(ckpt):
            os.kill(pid, signal.SIGKILL)
    finally:
        code, out, err = _finish(proc)
    assert code != 0
    names = sorted(os.listdir(ckpt))
    assert names == [".ckpt-00000008.h5.tmp", "ckpt-00000004.h5"], names  # no half file named like a checkpoint
    assert _ckpt("verify", os.path.join(ckpt, "ckpt-00000004.h5")).returncode == 0

    done = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable,
                           *_train_args(small_data[0], ckpt, 6, "--resume", "auto")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "removed" in done.stdout and ".ckpt-00000008.h5.tmp" in done.stdout
    assert f"resumed from {ckpt}/ckpt-00000004.h5 at step 4" in done.stdout, done.stdout
    assert not os.path.exists(os.path.join(ckpt, ".ckpt-00000008.h5.tmp"))


def test_ckpt_command_line(small_data, tmp_path):
    ckpt = str(tmp_path / "ck")
    # the checkpoints to read: the 1-rank run the command line makes, made in this process
    run = train_in_process(*_train_args(small_data[0], ckpt, 6, "--set", "checkpoint.every_steps=3")[3:])
    assert run["stopped_by"] is None and run["targets_met"], run  # exit code 0
    newest = os.path.join(ckpt, "ckpt-00000006.h5")
    ls = _ckpt("ls", ckpt)
    assert ls.returncode == 0 and ls.stdout.index("ckpt-00000006.h5") < ls.stdout.index("ckpt-00000003.h5")
    inspect = _ckpt("inspect", newest)
    assert inspect.returncode == 0
    for fragment in ("step = 6", "world_size = 1", "crc32 0x", "[optim]", "/optim/momentum/fc1/bias"):
        assert fragment in inspect.stdout, (fragment, inspect.stdout)
    assert re.search(r"/model/fc0/weight +\(\d+, 64\) +float32", inspect.stdout), inspect.stdout
    assert _ckpt("verify", newest).returncode == 0

    with open(newest, "r+b") as fh:  # truncate: verify names the file and fails
        fh.truncate(os.path.getsize(newest) // 3)
    bad = _ckpt("verify", newest)
    assert bad.returncode == 1 and "INVALID" in bad.stdout and "Traceback" not in bad.stderr
    assert _ckpt("ls", ckpt, "--verify").returncode == 1
    missing = _ckpt("ls", str(tmp_path / "nothing"))
    assert missing.returncode == 0 and "no checkpoints" in missing.stdout


def test_resume_from_a_missing_file_is_one_clear_error(small_data, tmp_path, capsys):
    _one_error_in_process(capsys, _train_setup(*_train_args(small_data[0], str(tmp_path / "ck"), 5,
                                                            "--resume", "/no/such.h5")[3:]), "/no/such.h5")


def test_unwritable_checkpoint_dir_is_one_clear_error(small_data, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    _one_error_in_process(capsys, _train_setup(*_train_args(small_data[0], str(blocker / "ck"), 5)[3:]),
                          "checkpoint.dir")

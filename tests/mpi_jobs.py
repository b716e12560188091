"""Launching real mpirun jobs from a test and acting on their ranks from outside
(signals, kill -9, SIGSTOP), as a user's job meets them. No MPI in the test process."""

import os
import signal
import subprocess
import sys
import time

from conftest import REPO


def env(**extra):
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1", **extra)


def start(n, args, **extra_env):
    return subprocess.Popen(["mpirun", "-n", str(n), "--oversubscribe", sys.executable, *args], cwd=REPO,
                            env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def rank_pids(marker):
    """Pids of the Python rank processes whose command line holds ``marker`` (not the launcher: mpirun,
    srun, a batch script)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if any(marker.encode() in a for a in argv) and os.path.basename(argv[0]).startswith(b"python"):
            if b"hpctrain" in argv:
                pids.append(int(entry))
    return sorted(pids)


def wait_for(predicate, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def ckpt_command(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"job did not end in {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err


def rank_pid(marker, rank):
    """Pid of MPI rank ``rank`` among the processes ``rank_pids(marker)`` finds (read from the launcher's
    environment variables), or None while it has not started."""
    for pid in rank_pids(marker):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = dict(v.split(b"=", 1) for v in fh.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if environ.get(b"OMPI_COMM_WORLD_RANK") == str(rank).encode():
            return pid
    return None


def kill_ranks(marker):
    """SIGKILL every process ``rank_pids(marker)`` finds (a test's leftover ranks)."""
    for pid in rank_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def metrics_steps(path):
    """Steps written so far to a train.metrics file (JSON lines; 0 when absent)."""
    try:
        with open(path) as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def alive(pids):
    """The pids of ``pids`` that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(")")[-1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out

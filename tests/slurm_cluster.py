"""The local SLURM cluster of the tests marked ``slurm`` (registered in conftest.py).

One cluster per session: munged, slurmctld and two slurmd (nodes n1, n2) on
this host, started by ``scripts/slurm-cluster.sh start`` and always stopped by
pid with ``scripts/slurm-cluster.sh stop``: in the fixture's finalizer, at
exit (atexit), and by a watchdog process that outlives pytest, for the cases
that skip both (pytest-timeout's ``os._exit``, a SIGKILL). Every wait on a job
has a timeout, and a job that runs over it is cancelled: a problem fails the
test, never hangs it. Skipped, with the reason printed, only where SLURM is not
installed (scripts/test.sh installs it as root with apt). HPCTRAIN_SLURM_KEEP=1
keeps the cluster's directory (config, daemon logs, jobcomp.txt) afterwards.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "slurm-cluster.sh")
NODES = 2
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}
# a calling shell's job or MPI identity must not leak into the test cluster's jobs
# (srun inside someone's allocation, PMIX_* of an MPI singleton in this process)
LEAKY_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "PMIX_", "PMI_", "OMPI_", "HPCTRAIN_")


def unavailable() -> str:
    """Why the cluster cannot start here ('' if it can)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [b for b in BINARIES if shutil.which(b, path=path) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not found); scripts/test.sh installs it as root "
                f"with apt ('bash scripts/slurm-cluster.sh install')")
    return ""


def parse_fields(line: str) -> dict:
    """``scontrol show job -o`` output (Key=Value ...) as a dict; values may not contain spaces."""
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


@dataclass
class Cluster:
    root: str  # the cluster's directory (config, logs)

    def env(self, two_nodes: bool = False, **extra) -> dict:
        """Environment for clients and jobs. ``two_nodes``: Open MPI over TCP on lo, because
        the simulated nodes share one hostname and its shared-memory transport collides."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKY_PREFIXES)}
        env.update(SLURM_CONF=os.path.join(self.root, "etc", "slurm.conf"), PYTHONUNBUFFERED="1",
                   HPCTRAIN_PYTHON=sys.executable, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        if two_nodes:
            env.update(OMPI_MCA_btl="self,tcp", OMPI_MCA_btl_tcp_if_include="lo")
        env.update(extra)
        return env

    def run(self, args: list[str], timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
        """A client command (srun, sbatch, scontrol ...); TimeoutExpired after ``timeout`` s."""
        return subprocess.run(args, env=env or self.env(), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)

    def sbatch(self, args: list[str], env=None, cwd=None) -> str:
        proc = self.run(["sbatch", "--parsable", *args], timeout=30, env=env, cwd=cwd)
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def jobs(self, job_id: str) -> list[dict]:
        """Every record of a job (an array job has one per task); [] while slurmctld does not answer."""
        try:
            proc = self.run(["scontrol", "show", "job", "-o", job_id], timeout=30)
        except subprocess.TimeoutExpired:  # a busy controller (seen under load): ask again
            return []
        return [parse_fields(line) for line in proc.stdout.splitlines() if line.startswith("JobId=")]

    def wait(self, job_id: str, timeout: float, output: str = "") -> list[dict]:
        """Wait until every record of ``job_id`` is in a final state; cancel it and fail after ``timeout`` s.

        A requeued job passes through REQUEUED and PENDING and is waited for.
        """
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            records = self.jobs(job_id)
            if records and all(r.get("JobState") in FINAL_STATES for r in records):
                return records
            time.sleep(0.25)  # a look costs ~20 ms; at 1 s, each wait lost 0.5 s on average
        self.run(["scancel", job_id], timeout=15)
        pytest.fail(f"job {job_id} not finished after {timeout:.0f} s (cancelled): "
                    f"{[(r.get('JobId'), r.get('JobState')) for r in self.jobs(job_id)]}\n"
                    f"--- output {output}:\n{tail(output)}\n--- slurmctld.log:\n"
                    f"{tail(os.path.join(self.root, 'log', 'slurmctld.log'))}")

    def jobcomp(self, job_id: str) -> list[str]:
        """The completion records of a job (jobcomp/filetxt: what sacct shows where accounting runs)."""
        path = os.path.join(self.root, "log", "jobcomp.txt")
        with open(path) as fh:
            return [line.strip() for line in fh if line.startswith(f"JobId={job_id} ")]


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


def _watchdog(root: str) -> subprocess.Popen:
    """A process that stops the cluster when this pytest process is gone, however it ended."""
    script = f'while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; exec bash "$0" stop "$1"'
    return subprocess.Popen(["bash", "-c", script, SCRIPT, root], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="hpctrain-slurm-")  # short: munge's socket path must fit in 108 bytes
    watchdog = _watchdog(root)

    def stop():
        subprocess.run(["bash", SCRIPT, "stop", root], capture_output=True, timeout=120)

    atexit.register(stop)
    try:
        proc = subprocess.run(["bash", SCRIPT, "start", root, str(NODES)], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            pytest.fail(f"the test cluster did not start:\n{proc.stdout}{proc.stderr}")
        yield Cluster(root)
    finally:
        stop()
        atexit.unregister(stop)
        watchdog.kill()
        watchdog.wait()
        if os.environ.get("HPCTRAIN_SLURM_KEEP"):  # keep config and logs to look at
            print(f"\nslurm test cluster kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

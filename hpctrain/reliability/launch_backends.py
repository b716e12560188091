"""Where ``python -m hpctrain launch`` starts each run: mpirun, or srun inside a SLURM allocation.

A back-end turns "start the job (again)" into a command line, says where it runs, and ends a job
whose ranks the heartbeats found lost (``tear_down``):

  ``Mpirun(n, options)``  ``mpirun -n N [options] python -m hpctrain train ...``, every time.
  ``Srun(options)``       inside ``sbatch --no-kill`` (jobs/requeue.sbatch): ``srun --kill-on-bad-exit=1
                          [options] ...`` over the allocation; before a restart it keeps the nodes that
                          still work (SLURM's node states, then a one-task probe on each, at once, with a
                          time limit) at the same ranks per node, with ``--overlap`` (the failed step
                          holds its CPUs until SLURM hears from a lost node). None left: :class:`NoNodes`.

The launcher runs on the allocation's first node; if that node dies SLURM ends the job whatever
``--no-kill`` says (docs/reliability.md, "Inside a SLURM allocation").
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time

PROBE_S = 20  # a working node answers a one-task srun in about a second; a dead one never does
# sinfo's short states (%t) in which a node can run a step; a suffix (* not responding,
# ~ powered off, # powering up, % powering down, ! pending power down, $ maintenance,
# @ pending reboot, ^ rebooting, - planned) rules it out, as do down, drain, fail, maint...
USABLE_STATES = {"alloc", "mix", "idle", "comp", "resv", "plnd", "drng"}  # draining: new jobs no, our steps yes


class NoNodes(RuntimeError):
    """No node of the allocation can run the job any more."""


class Mpirun:
    """Every start: ``mpirun -n N [options]`` (the same hosts, the same world size)."""

    def __init__(self, n: int, options: list[str], mpirun: str = "mpirun"):
        self.n, self.options, self.program = n, options, mpirun

    def problem(self) -> str | None:
        if shutil.which(self.program) is None:
            return f"{self.program!r} is not on PATH; load your MPI (module load ...) first"
        return None

    def progress_dir(self) -> str | None:
        return None  # mpirun's rank 0 runs here (a temporary folder of this machine)

    probed = False  # no node probes: the same hosts every time

    def start(self, restart: int, command: list[str], say, lost_nodes=()) -> tuple[list[str], str]:
        """(argv, "N rank(s) on WHERE") for one start of ``command`` (hpctrain's arguments); the
        same hosts after a failure, whatever was lost (mpirun's options name them)."""
        argv = [self.program, "-n", str(self.n), *self.options, sys.executable, "-m", "hpctrain", *command]
        return argv, f"{self.n} rank(s) on {hosts_of(self.options)}"

    def tear_down(self, proc, say) -> None:
        """End the job now: SIGKILL to mpirun and every process under it (a stopped rank too;
        mpirun alone would wait for it). Ranks on other hosts end when mpirun's daemons lose it."""
        kill_tree(proc.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it (the tree read from /proc). The tree is stopped
    first, from the top, so nothing in it reacts to the kills: a parent that saw its children die
    first could otherwise exit by itself in between (a shell's ``wait`` returns, mpirun reports its
    ranks' deaths). A child forked between the /proc read and its parent's stop is not seen."""
    import signal

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    order, todo = [], [pid]
    while todo:
        p = todo.pop()
        order.append(p)
        todo += children.get(p, [])
    for sig, pids in ((signal.SIGSTOP, order), (signal.SIGKILL, reversed(order))):
        for p in pids:
            try:
                os.kill(p, sig)
            except OSError:
                pass


def hosts_of(options: list[str]) -> str:
    """The hosts named in mpirun's options, or this machine."""
    for i, arg in enumerate(options):
        if arg in ("-H", "--host", "-host", "--hostfile", "-hostfile", "--machinefile") and i + 1 < len(options):
            return options[i + 1]
    return socket.gethostname()


def tasks_per_node(env) -> int | None:
    """Ranks per node of the allocation: SLURM_NTASKS_PER_NODE, else the smallest count of
    SLURM_TASKS_PER_NODE ("4(x2)", or "4(x2),3" when nodes differ: a restart then asks no node
    for more than the smallest has), else SLURM_NTASKS / SLURM_JOB_NUM_NODES."""
    m = re.match(r"(\d+)", env.get("SLURM_NTASKS_PER_NODE", ""))
    if m:
        return int(m.group(1))
    counts = [int(c) for c in re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_TASKS_PER_NODE", ""))]
    if counts:
        return min(counts)
    try:
        return max(1, int(env["SLURM_NTASKS"]) // int(env["SLURM_JOB_NUM_NODES"]))
    except (KeyError, ValueError, ZeroDivisionError):
        return None


class Srun:
    """Every start an srun step inside this allocation; after a failure, on the nodes that still work."""

    probed = False  # whether the last start probed the nodes (restarts do)

    def __init__(self, options: list[str], env=None, srun: str = "srun", probe_s: float = PROBE_S):
        self.options, self.program, self.probe_s = options, srun, probe_s
        self.env = os.environ if env is None else env
        self.nodes: list[str] = []
        self.cancelling: list = []  # scancel processes of torn-down steps, not waited for

    def problem(self) -> str | None:
        for tool in (self.program, "scontrol", "sinfo"):
            if shutil.which(tool) is None:
                return f"{tool!r} is not on PATH; --srun runs inside a SLURM allocation (sbatch jobs/requeue.sbatch)"
        if not self.env.get("SLURM_JOB_ID") or not self.env.get("SLURM_JOB_NODELIST"):
            return "--srun runs inside a SLURM allocation (SLURM_JOB_ID is not set): use it from an sbatch script"
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", self.env["SLURM_JOB_NODELIST"]],
                                 capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return "scontrol show hostnames did not answer in 30 s: is slurmctld reachable?"
        self.nodes = out.stdout.split()
        if out.returncode or not self.nodes:
            return f"scontrol show hostnames {self.env['SLURM_JOB_NODELIST']} failed: {out.stderr.strip()}"
        if tasks_per_node(self.env) is None:
            return "cannot tell the ranks per node (SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE, SLURM_NTASKS)"
        return None

    def progress_dir(self) -> str:
        """Where the job's rank 0 can write: the submit folder (shared, as sbatch's output is)."""
        return self.env.get("SLURM_SUBMIT_DIR") or os.getcwd()

    def start(self, restart: int, command: list[str], say, lost_nodes=()) -> tuple[list[str], str]:
        """(argv, "N rank(s) on WHERE"); a restart runs on the nodes that still work, ``lost_nodes``
        (the heartbeats' verdict) left out without a probe."""
        # a restart's geometry comes after the user's options: srun takes the last of a repeated
        # option, so an -n or -N in SRUN_ARGS cannot bring a lost node back
        head = [self.program, "--kill-on-bad-exit=1", *self.options]
        tail = [sys.executable, "-m", "hpctrain", *command]
        per_node = tasks_per_node(self.env)
        everywhere = f"{self.env.get('SLURM_NTASKS', per_node * len(self.nodes))} rank(s) on " \
                     f"{len(self.nodes)} node(s) {','.join(self.nodes)}"
        self.probed = restart > 0
        if restart == 0:
            return head + tail, everywhere
        good = self.usable_nodes(say, lost_nodes)
        if not good:
            raise NoNodes(f"none of the allocation's nodes ({','.join(self.nodes)}) can run a task any more")
        if good == self.nodes:
            return head + ["--overlap"] + tail, everywhere
        n = per_node * len(good)
        where = f"{n} rank(s) on {len(good)} node(s) {','.join(good)} ({len(self.nodes) - len(good)} of " \
                f"{len(self.nodes)} lost)"
        # --overlap: the failed step holds its CPUs until every node it ran on has answered, and
        # a lost node answers only when SLURM declares it down (SlurmdTimeout, minutes later)
        return head + ["--overlap", "-N", str(len(good)), "-n", str(n), "-w", ",".join(good)] + tail, where

    def usable_nodes(self, say, lost_nodes=()) -> list[str]:
        """The allocation's nodes that SLURM calls usable and that run a one-task srun within probe_s,
        but for ``lost_nodes``: their ranks stopped answering, and a dead node's probe would only
        wait out probe_s (SLURM calls it usable until SlurmdTimeout)."""
        states = self.states()  # {} when sinfo does not answer: the probes alone decide
        candidates = []
        for node in self.nodes:
            state = states.get(node, "unknown")
            if node in lost_nodes:
                say(f"node {node} is not usable: its ranks stopped answering (no heartbeat)")
            elif not states or state in USABLE_STATES:
                candidates.append(node)
            else:
                say(f"node {node} is not usable: SLURM state {state!r}")
        probes = {node: subprocess.Popen([self.program, "--overlap", "-N", "1", "-n", "1", "-w", node,
                                          "--kill-on-bad-exit=1", "true"], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                  for node in candidates}
        good, deadline = [], time.monotonic() + self.probe_s  # one limit for all: they run at once
        for node, proc in probes.items():
            try:
                _, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()  # srun cancels its step on SIGTERM (SIGKILL would leave it registered)
                try:
                    proc.communicate(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()
                say(f"node {node} is not usable: a one-task srun did not finish in {self.probe_s:g} s")
                continue
            if proc.returncode == 0:
                good.append(node)
            else:
                last = (err.strip().splitlines() or ["no message"])[-1]
                say(f"node {node} is not usable: a one-task srun failed ({last})")
        return good

    def tear_down(self, proc, say) -> None:
        """End the job's step now: ``scancel --signal=KILL`` of this allocation's running steps (the
        batch script's own excepted), which reaches the ranks on every node that still answers,
        then SIGKILL to the srun client, which would otherwise wait for the lost node's tasks
        until SLURM declares it down. scancel is not waited for: with a node gone its answer can
        take as long as slurmctld's message timeout (10 s measured), and the restart's own step runs
        with --overlap beside whatever is left. (A probe step never runs at the same time.)"""
        job = self.env.get("SLURM_JOB_ID", "")
        try:
            out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True,
                                 timeout=5).stdout.split()
            steps = [s for s in out if re.fullmatch(rf"{re.escape(job)}\.\d+", s)]
            if steps:
                self.cancelling.append(subprocess.Popen(["scancel", "--signal=KILL", *steps],
                                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.DEVNULL))
        except (OSError, subprocess.TimeoutExpired) as exc:
            say(f"could not list the job's steps ({exc}); ending srun alone")
        proc.kill()
        self.cancelling = [p for p in self.cancelling if p.poll() is None]  # reap the ones that ended

    def states(self) -> dict[str, str]:
        """{node: sinfo's short state} for the allocation's nodes ({} when sinfo fails)."""
        try:
            out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(self.nodes), "-o", "%N %t"],
                                 capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return {}
        states = {}
        for line in out.stdout.splitlines():
            fields = line.split()
            if len(fields) == 2:
                states[fields[0]] = fields[1]
        return states

"""``python -m hpctrain launch``: run a training job and restart it after a failure (docs/reliability.md).

    python -m hpctrain launch -n 4 [--max-failures 3] [mpirun options] -- train --config my.toml
    python -m hpctrain launch --srun [--max-failures 3] [srun options] -- train --config my.toml

:class:`Supervisor` starts the job through a back-end (:mod:`.launch_backends`) and judges each end:
0, 75 (saved after a signal), 2, 3 and 5 (user error, missed target, divergence) are final and
become the launcher's exit code; anything else is a failure, restarted with ``--resume auto`` up to
``--max-failures`` times (``HPCTRAIN_MAX_FAILURES``, else 3). Too many failures, two in a row before
a completed step, or no usable node left: it gives up with :data:`~hpctrain.errors.EXIT_GAVE_UP`.
SIGUSR1/SIGTERM to the launcher reach the job as SIGUSR1 (save, exit 75, no restart). Heartbeats
(:mod:`.heartbeat`) end the job early: ranks silent for ``HPCTRAIN_DETECT_S`` (a restart, under srun
without their lost nodes), or a job still running ``HPCTRAIN_EXIT_GRACE_S`` after every rank said its
run was over (no restart: the code the ranks said). Each restart's cost is logged phase by phase
from the job's marks (:mod:`.progress`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from . import heartbeat, progress
from .launch_backends import Mpirun, NoNodes, Srun
from ..errors import (EXIT_CHECKPOINTED, EXIT_DIVERGED, EXIT_GAVE_UP, EXIT_TARGET_MISSED, EXIT_USER_ERROR,
                      ConfigError)

FINAL = {0: "finished", EXIT_CHECKPOINTED: "stopped after saving a checkpoint", EXIT_USER_ERROR: "ended with a user error",
         EXIT_TARGET_MISSED: "finished with its target missed", EXIT_DIVERGED: "diverged"}
POLL_S = 0.05  # how often the job's progress file is read while it runs


def usage_error(message: str) -> int:
    print(f"hpctrain launch: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def split_args(argv: list[str]):
    """``-n N | --srun  [--max-failures K] [mpirun or srun options] -- hpctrain command`` ->
    (n or None under --srun, k, options, command, srun?). Under --srun every option but
    --max-failures is srun's, -n included (the ranks of the first start: the allocation's
    by default; a restart on fewer nodes sets its own)."""
    if "--" not in argv:
        raise ValueError("expected '-- train ARGS' after the launcher's options")
    cut = argv.index("--")
    mine, command = argv[:cut], argv[cut + 1:]
    srun = "--srun" in mine
    n, k, options, i = None, None, [], 0
    while i < len(mine):
        arg = mine[i]
        name, _, inline = arg.partition("=")
        if arg == "--srun":
            i += 1
            continue
        # under --srun, -n is srun's own option (the first start's ranks; a restart sets its own)
        if name == "--max-failures" or (name in ("-n", "-np", "--np") and not srun):
            value = inline if inline else (mine[i + 1] if i + 1 < len(mine) else "")
            i += 1 if inline else 2
            if not value.isdigit():
                raise ValueError(f"{name} needs a whole number, got {value!r}")
            if name == "--max-failures":
                k = int(value)
            else:
                n = int(value)
            continue
        options.append(arg)
        i += 1
    if not srun and (n is None or n < 1):
        raise ValueError("-n N (the number of ranks, >= 1) is required")
    if not command or command[0] != "train":
        raise ValueError(f"the command after '--' must be 'train ...', got {' '.join(command) or 'nothing'!r}")
    if k is None:
        env = os.environ.get("HPCTRAIN_MAX_FAILURES", "3")
        if not env.isdigit():
            raise ValueError(f"HPCTRAIN_MAX_FAILURES={env!r} must be a whole number")
        k = int(env)
    return n, k, options, command, srun


def with_resume_auto(command: list[str]) -> list[str]:
    """The train command with ``--resume auto`` (any --resume of the user's replaced)."""
    out, i = [], 0
    while i < len(command):
        if command[i] == "--resume":
            i += 2
            continue
        if command[i].startswith("--resume="):
            i += 1
            continue
        out.append(command[i])
        i += 1
    return out + ["--resume", "auto"]


def describe_exit(rc: int) -> str:
    if rc < 0:
        return f"mpirun or srun killed by signal {-rc} ({signal.Signals(-rc).name})"
    if rc > 128 and rc - 128 in signal.valid_signals():
        return f"exit code {rc} (a rank killed by signal {rc - 128}, {signal.Signals(rc - 128).name})"
    if rc == 4:
        return "exit code 4 (the stall watchdog ended a stalled job)"
    return f"exit code {rc}"


class Lost:
    """What the heartbeats say is gone: ``silent`` (rank, node, seconds) of the ranks that stopped
    beating; a node is lost when every rank heard from it is silent."""

    def __init__(self, silent, heard_nodes: dict):
        self.silent = silent
        self.ranks = [r for r, _, _ in silent]
        quiet = {node for _, node, _ in silent}
        self.nodes = sorted(n for n in quiet if all(r in self.ranks for r in heard_nodes.get(n, ())))
        self.seconds = min(s for _, _, s in silent)

    def describe(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        if self.nodes:
            return (f"node(s) {','.join(self.nodes)} stopped answering (rank(s) {ranks} silent for "
                    f"{self.seconds:.1f} s: no heartbeat)")
        return (f"rank(s) {ranks} stopped answering (silent for {self.seconds:.1f} s: no heartbeat; "
                f"their nodes' other ranks still beat)")


class Supervisor:
    """Runs the job, judges each end, restarts; ``run()`` returns the launcher's exit code.
    ``detect_s``: the heartbeats' limit (None: ``HPCTRAIN_DETECT_S`` or its default; 0: off)."""

    def __init__(self, backend, max_failures, command, say=None, detect_s=None):
        self.backend, self.max_failures, self.command = backend, max_failures, command
        self.say = say or (lambda line: print(f"hpctrain launch: {line}", flush=True))
        self.proc = None
        self.stop = None  # the signal that asked the job to stop: no restart after it
        self.detect_s = heartbeat.detect_s() if detect_s is None else detect_s
        self.exit_grace_s = heartbeat.exit_grace_s()
        self.listener = None

    def _forward(self, signum, frame):
        self.stop = signal.Signals(signum).name
        if self.proc is not None and self.proc.poll() is None:
            self.say(f"got {self.stop}: passing SIGUSR1 to the job (save and stop)")
            self.proc.send_signal(signal.SIGUSR1)

    def run(self) -> int:
        problem = self.backend.problem()
        if problem:
            return usage_error(problem)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._forward)
        # the progress file must be where the job's rank 0 runs: a shared folder under srun
        try:
            folder = tempfile.TemporaryDirectory(prefix=".hpctrain-launch-", dir=self.backend.progress_dir())
        except OSError:  # not writable: this machine's, which rank 0 shares when it runs here
            folder = tempfile.TemporaryDirectory(prefix="hpctrain-launch-")
        self.listener = heartbeat.Listener() if self.detect_s > 0 else None
        try:
            with folder as tmp:
                return self._loop(os.path.join(tmp, "progress"))
        finally:
            if self.listener is not None:
                self.listener.close()

    def _loop(self, progress_path: str) -> int:
        failures, idle_failures, command, failed_at, last, lost = 0, 0, self.command, None, None, None
        phases_before = {}  # a restart's phases before it starts: detection, tear-down
        while True:
            if os.path.exists(progress_path):
                os.remove(progress_path)
            t_probe = time.time()
            try:
                cmd, where = self.backend.start(failures, command, self.say, lost.nodes if lost else ())
            except NoNodes as exc:
                return self._give_up(str(exc))
            probes = time.time() - t_probe if getattr(self.backend, "probed", False) else None
            if self.stop is not None:  # it came while no job ran (the probes take seconds): start none
                when = "between a failure and its restart" if failures else "before the job started"
                self.say(f"{self.stop} arrived {when}: not starting it; the newest checkpoint stays in "
                         f"checkpoint.dir (exit {EXIT_CHECKPOINTED}, as after a save)")
                return EXIT_CHECKPOINTED
            env = dict(os.environ, **{progress.ENV: progress_path, "HPCTRAIN_RESTART": str(failures)})
            if self.listener is not None:
                env[heartbeat.ENV] = self.listener.env_value(failures)
            phases = dict(phases_before, probes=probes) if failures else {}
            started = time.time()
            self.say(f"{'start' if not failures else f'restart {failures} of at most {self.max_failures}'}: "
                     f"{where}: {' '.join(cmd[:cmd.index(sys.executable)])} ... {' '.join(command)}")
            self.proc = subprocess.Popen(cmd, env=env)
            reported, lost, stuck = failed_at is None, None, None
            while True:
                try:
                    rc = self.proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if not reported:
                        reported = self._report_recovery(progress_path, failed_at, last, phases, started)
                    if lost is None and self.stop is None:
                        lost = self._heard_lost()
                    if lost is None and stuck is None:
                        stuck = self._stuck_in_exit()
                except KeyboardInterrupt:  # Ctrl-C reached mpirun too (same process group): it ends the job
                    self.stop = "SIGINT"
            ended = time.time()
            if stuck is not None:  # the run was over on every rank: its own code, not the tear-down's
                rc = stuck
            elif rc not in FINAL:
                rc = self._over_before(rc)
            marks = progress.read(progress_path)
            if self.listener is not None and lost is None:
                self.listener.poll()
                if self.listener.heard or self.listener.done:
                    self.say(f"heartbeats: the largest gap between two beats of a rank was "
                             f"{self.listener.largest_gap:.1f} s (a rank is lost after {self.detect_s:g} s)")
            if not reported:
                self._report_recovery(progress_path, failed_at, last, phases, started, final=True)
            if self.stop is not None and rc in (-signal.SIGUSR1, 128 + signal.SIGUSR1) and "ready" not in marks:
                # the ranks got SIGUSR1 before hpctrain set its handler (Python still starting):
                # they had nothing to save, and the newest checkpoint is the one to resume from
                self.say(f"{self.stop} reached the job before it could save (still starting): nothing lost")
                rc = EXIT_CHECKPOINTED
            if rc in FINAL or self.stop is not None:
                what = FINAL.get(rc) or f"ended with {describe_exit(rc)}"
                self.say(f"the job {what}" + (f" (after {failures} restart(s))" if failures else "")
                         + (f"; {self.stop} asked it to stop, so no restart" if self.stop and rc else ""))
                return rc if rc >= 0 else 128 - rc
            failures += 1
            ready, step = marks.get("ready"), marks.get("step")
            progressed = step is not None and ready is not None and step.step > ready.step
            idle_failures = 0 if progressed else idle_failures + 1
            last = step.step if step is not None else (ready.step if ready is not None else None)
            reached = f"at step {last}" if last is not None else "before its first step"
            cause = lost.describe() if lost is not None else describe_exit(rc)
            self.say(f"failure {failures}: {cause} {reached}, {ended - started:.1f} s after its start")
            if idle_failures >= 2:
                return self._give_up(f"the job failed twice in a row before completing a step (last: "
                                     f"{describe_exit(rc)}); that is not transient: fix the cause and run again")
            if failures > self.max_failures:
                return self._give_up(f"{failures} failure(s), more than --max-failures={self.max_failures} "
                                     f"(last: {describe_exit(rc)})")
            command = with_resume_auto(self.command)
            if lost is not None:  # the failure: when the lost ranks fell silent
                failed_at = lost.detected_at - lost.seconds
                phases_before = {"detection": lost.seconds, "tear-down": ended - lost.detected_at}
            else:
                failed_at, phases_before = ended, {}

    def _heard_lost(self):
        """The heartbeats: a :class:`Lost` (and the job torn down) when ranks heard before fell silent."""
        if self.listener is None:
            return None
        self.listener.poll()
        if self.listener.done:  # the run is ending: ranks may be quiet in MPI_Finalize (_stuck_in_exit)
            return None
        if self.listener.gone:  # a rank died on a live node: mpirun or srun ends the job and says so,
            return None         # and the silence of its tear-down is not a lost node
        if not self.listener.silent(self.detect_s):
            return None
        # the first rank over the limit says when; every rank that has missed beats by then (silent
        # for two periods) is lost with it: the ranks of one crashed node beat out of phase, up to a
        # period apart, and judged one by one the node would look alive and be probed (10 s or more)
        silent = self.listener.silent(min(self.detect_s, 2 * heartbeat.PERIOD_S))
        by_node = {}
        for rank, (_, node) in self.listener.heard.items():
            by_node.setdefault(node, []).append(rank)
        lost = Lost(silent, by_node)
        lost.detected_at = time.time()
        self.say(f"{lost.describe()}: ending the job")
        self.backend.tear_down(self.proc, self.say)
        return lost

    def _over_before(self, rc: int) -> int:
        """``rc``, or the code every rank said when each rank heard had said its run was over
        before the job failed (a crash in MPI_Finalize or at interpreter exit: nothing is lost,
        nothing to restart)."""
        if self.listener is None:
            return rc
        self.listener.poll()
        code = self.listener.agreed_code()
        if not self.listener.done or self.listener.heard or self.listener.gone or code is None:
            return rc
        self.say(f"the job ended with {describe_exit(rc)} after every rank's run was over (exit code {code}): "
                 f"taking {code}")
        return code

    def _stuck_in_exit(self):
        """The exit code every rank said when all said bye more than the exit grace ago and the job
        still runs (and the job torn down); None otherwise. Ranks that said different codes, or a bye
        without one: 1, a failure."""
        if self.listener is None or not self.exit_grace_s:
            return None
        self.listener.poll()  # here too: after a stop signal _heard_lost no longer reads the beats
        if not self.listener.all_done(self.exit_grace_s):
            return None
        code = self.listener.agreed_code()
        code = 1 if code is None else code
        ranks = ", ".join(map(str, sorted(self.listener.done)))
        quiet = ", ".join(map(str, sorted(self.listener.heard)))
        self.say(f"every rank's run was over (rank(s) {ranks} said so" + (f"; rank(s) {quiet} fell silent"
                 if quiet else "") + f"; exit code {code}) but the job had not ended {self.exit_grace_s:g} s "
                 f"later (a rank stuck in its exit, the others in MPI_Finalize): ending it")
        self.backend.tear_down(self.proc, self.say)
        return code

    def _report_recovery(self, path, failed_at, last_step, phases, started, final=False) -> bool:
        """Print what the restart cost once its first step is done (or, ``final``, as far as it got),
        phase by phase: ``phases`` holds those before the restart (detection and tear-down when the
        heartbeats found the failure, the node probes), ``started`` is when the restart began."""
        marks = progress.read(path)
        start, ready, step = marks.get("start"), marks.get("ready"), marks.get("step")
        if step is None and not final:
            return False
        parts = [f"{name} {s:.1f} s" for name, s in (("detection", phases.get("detection")),
                                                      ("tear-down", phases.get("tear-down")),
                                                      ("node probes", phases.get("probes"))) if s is not None]
        if start is not None:
            parts.append(f"start-up {start.time - started:.1f} s")
        if start is not None and ready is not None:
            parts.append(f"checkpoint load and set-up {ready.time - start.time:.1f} s")
        if ready is not None and step is not None:
            parts.append(f"first step {step.time - ready.time:.1f} s")
        resumed = f"resumed at step {ready.step}" if ready is not None else "never got ready"
        redone = (f", {max(0, last_step - ready.step)} step(s) redone" if ready is not None and last_step is not None
                  else "")
        origin = "the failure" if "detection" in phases else "the failed job ended"
        if step is not None:
            self.say(f"recovered: first new step {step.time - failed_at:.1f} s after {origin} "
                     f"({', '.join(parts)}); {resumed}{redone}")
        else:
            self.say(f"the restarted job ended before its first step ({', '.join(parts) or 'no start-up'}); "
                     f"{resumed}")
        return True

    def _give_up(self, why: str) -> int:
        print(f"hpctrain launch: error: giving up: {why}; the newest checkpoint stays in checkpoint.dir "
              f"(--resume auto continues from it)", file=sys.stderr, flush=True)
        return EXIT_GAVE_UP


def cmd_launch(argv: list[str]) -> int:
    try:
        n, k, options, command, srun = split_args(argv)
    except ValueError as exc:
        return usage_error(f"{exc}\nusage: python -m hpctrain launch -n N [--max-failures K] [mpirun options] "
                           f"-- train ARGS\n       python -m hpctrain launch --srun [--max-failures K] "
                           f"[srun options] -- train ARGS  (inside a SLURM allocation)")
    try:
        supervisor = Supervisor(Srun(options) if srun else Mpirun(n, options), k, command)
    except ConfigError as exc:  # HPCTRAIN_DETECT_S or HPCTRAIN_EXIT_GRACE_S unreadable
        return usage_error(str(exc))
    return supervisor.run()

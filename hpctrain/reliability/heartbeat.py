"""Heartbeats outside MPI: a supervising launcher hears every rank each second, so a lost node is
noticed in seconds, not at a collective's timeout or SLURM's (docs/reliability.md).

Rank side (:class:`Beacon`, when ``HPCTRAIN_LAUNCH_BEACON=HOST:PORT:START`` is set): a small process
of its own (a rank holding the GIL for seconds must not look lost) sends a UDP datagram
``rank node start`` every :data:`PERIOD_S` while its rank runs; it falls silent when the rank is
stopped or its node is lost, says ``... gone`` when the rank's process dies on a live node, and at
the end of the run the rank sends ``... bye CODE`` (its exit code). ``start`` tells apart the
datagrams of a start already given up on.

Launcher side (:class:`Listener`): :meth:`~Listener.poll` drains the socket; :meth:`~Listener.silent`
names ranks heard before and silent longer than ``HPCTRAIN_DETECT_S`` (:data:`DETECT_S`); ranks never
heard, and ranks that said bye, are not judged for silence. :meth:`~Listener.all_done`: the latest bye
is older than ``HPCTRAIN_EXIT_GRACE_S`` (:data:`EXIT_GRACE_S`; 0 never) and no rank has beaten since:
the job is stuck in its exit. A limit spans many beats, so a few dropped datagrams never add up to it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

ENV = "HPCTRAIN_LAUNCH_BEACON"
PERIOD_S = 1.0     # a beat per rank per second: 100 bytes, nothing next to a training step
DETECT_S = 5.0     # silence that makes a rank lost: five beats missed (the busiest 2-core node: 1.1 s at most)
EXIT_GRACE_S = 60.0  # after every rank said bye, how long leaving MPI and Python may take

# The beacon process: beats while its rank (argv[4]) runs and is not stopped, until the rank kills
# it. Standard library only: it starts in milliseconds.
BEACON = r"""
import os, socket, sys, time
host, port, payload, rank_pid, period = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), int(sys.argv[4]), float(sys.argv[5])
where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
sock = socket.socket(where[0], where[1], where[2])
def state():
    try:
        with open(f"/proc/{rank_pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
while True:
    s = state()
    if s in ("gone", "Z", "X") or os.getppid() != rank_pid:
        for _ in range(3):           # the rank died, its node lives: say so (UDP may drop one), end
            try:
                sock.sendto(payload + b" gone", where[4])
            except OSError:
                pass
        os._exit(0)
    if s not in ("T", "t"):          # stopped: silent until it runs again
        try:
            sock.sendto(payload, where[4])
        except OSError:
            pass
    time.sleep(period)
"""


class Beacon:
    """This rank's heartbeat to the launcher (nothing without ``HPCTRAIN_LAUNCH_BEACON``)."""

    def __init__(self, rank: int, env=None, period_s: float = PERIOD_S):
        env = os.environ if env is None else env
        self.rank, self.period_s = rank, period_s
        self._target = _parse(env.get(ENV, ""))
        self._proc = None
        self._payload = ""

    @property
    def enabled(self) -> bool:
        return self._target is not None

    def start(self) -> None:
        if self._target is None or self._proc is not None:
            return
        host, port, start = self._target
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self._payload = f"{self.rank} {node} {start}"
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", "-c", BEACON, host, str(port), self._payload, str(os.getpid()),
                 str(self.period_s)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, close_fds=True,
                # its own session: a job torn down by process group (srun's proctrack/pgid, mpirun)
                # after a rank died must not take the beacon before it says so; it ends by itself
                # within a beat of its rank
                start_new_session=True)
        except OSError:
            self._proc = None  # no beacon: the launcher falls back on its other means for this rank

    def stop(self, bye: bool = True, code: int | None = None) -> None:
        """Stop beating; ``bye``: tell the launcher this rank's run is over and, ``code``, the exit
        code it ends with (None: not known, the run raised); False: fall silent, as a dead rank does."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.kill()
            proc.wait(timeout=5)  # gone before the bye: no beat of it arrives after
        except (OSError, subprocess.TimeoutExpired):
            pass
        if not bye:
            return
        host, port, _ = self._target
        message = f"{self._payload} bye {'-' if code is None else int(code)}".encode()
        try:
            where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
            with socket.socket(where[0], where[1], where[2]) as sock:
                for i in range(3):  # UDP may drop one; spaced, as every rank says bye at once
                    if i:
                        time.sleep(0.01)
                    sock.sendto(message, where[4])
        except OSError:
            pass  # unheard: the launcher takes the rank for silent, as it would a dead one


def _parse(text: str):
    """``HOST:PORT:START`` -> (host, port, start), or None."""
    host, _, rest = text.rpartition(":")
    host, _, port = host.rpartition(":")
    if not host or not port.isdigit() or not rest.isdigit():
        return None
    return host, int(port), int(rest)


class Listener:
    """The launcher's ear: who beat when, for the current start."""

    def __init__(self, host: str | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:  # every rank's bye arrives at once: room for thousands (the kernel may cap it lower)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        except OSError:
            pass
        self.sock.bind(("", 0))
        self.sock.setblocking(False)
        self.host = host or socket.gethostname()
        self.start_number = 0
        self.heard: dict[int, tuple[float, str]] = {}   # rank -> (last time, node)
        self.done: set[int] = set()                      # ranks that said bye: no longer judged
        self.codes: dict[int, int | None] = {}            # the exit code each said (None: unknown)
        self.gone: dict[int, str] = {}                    # rank -> node, of ranks whose process died
        self.last_bye = 0.0                               # when the latest bye came (monotonic)
        self.largest_gap = 0.0                            # between two beats of a rank, this start

    def env_value(self, start_number: int) -> str:
        """``HPCTRAIN_LAUNCH_BEACON`` for the job's start ``start_number`` (forgets older beats)."""
        self.start_number, self.heard, self.done, self.largest_gap = start_number, {}, set(), 0.0
        self.codes, self.last_bye, self.gone = {}, 0.0, {}
        return f"{self.host}:{self.sock.getsockname()[1]}:{start_number}"

    def poll(self, now: float | None = None) -> None:
        """Take in every datagram that arrived."""
        now = time.monotonic() if now is None else now
        while True:
            try:
                data = self.sock.recv(256)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            fields = data.decode(errors="replace").split()
            if len(fields) in (3, 4, 5) and fields[0].isdigit() and fields[2] == str(self.start_number):
                rank = int(fields[0])
                if len(fields) == 4 and fields[3] == "gone":
                    if rank not in self.done:
                        self.gone[rank] = fields[1]
                    self.heard.pop(rank, None)
                    continue
                if len(fields) == 5 and fields[3] == "bye":
                    if rank not in self.done:
                        self.done.add(rank)
                        self.codes[rank] = int(fields[4]) if fields[4].lstrip("-").isdigit() else None
                        self.last_bye = now
                    self.heard.pop(rank, None)
                elif len(fields) == 3 and rank not in self.done and rank not in self.gone:
                    if rank in self.heard:
                        self.largest_gap = max(self.largest_gap, now - self.heard[rank][0])
                    self.heard[rank] = (now, fields[1])

    def silent(self, limit_s: float, now: float | None = None) -> list[tuple[int, str, float]]:
        """(rank, node, seconds) of each rank heard in this start but not for longer than ``limit_s``."""
        now = time.monotonic() if now is None else now
        return sorted((rank, node, now - t) for rank, (t, node) in self.heard.items() if now - t > limit_s)

    def agreed_code(self) -> int | None:
        """The exit code every rank that said bye said; None when they differ or one gave none."""
        codes = set(self.codes.values())
        return codes.pop() if len(codes) == 1 and None not in codes else None

    def all_done(self, grace_s: float, now: float | None = None) -> bool:
        """Some rank said bye, the latest more than ``grace_s`` ago, and no rank has beaten for as
        long (a rank heard but without a bye: its bye was dropped, or it died in its exit)."""
        now = time.monotonic() if now is None else now
        return (bool(self.done) and now - self.last_bye > grace_s
                and all(now - t > grace_s for t, _ in self.heard.values()))

    def nodes(self) -> set[str]:
        return {node for _, node in self.heard.values()}

    def close(self) -> None:
        self.sock.close()


def detect_s(env=None) -> float:
    """The silence that makes a rank lost: ``HPCTRAIN_DETECT_S`` (0 turns the detector off)."""
    return _seconds(env, "HPCTRAIN_DETECT_S", DETECT_S, "0: no heartbeats")


def exit_grace_s(env=None) -> float:
    """How long a job may take to end after every rank said bye: ``HPCTRAIN_EXIT_GRACE_S``."""
    return _seconds(env, "HPCTRAIN_EXIT_GRACE_S", EXIT_GRACE_S, "after the run is over; 0: wait forever")


def _seconds(env, name: str, default: float, meaning: str) -> float:
    env = os.environ if env is None else env
    text = env.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value >= 0:
        from ..errors import ConfigError

        raise ConfigError(f"{name}={text!r}: expected a number of seconds ({meaning})")
    return value

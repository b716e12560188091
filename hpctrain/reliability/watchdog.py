"""Stall watchdog: a collective that does not complete in ``dist.comm_timeout`` ends the job with a diagnostic.

The trainer marks each blocking collective with :meth:`Watchdog.watch` (regions that also do real
work, such as saves, loads, evaluation and start-up, get ``slack`` times the limit). A daemon thread
per rank ("hpctrain-watchdog") wakes every ``poll`` seconds, answers the other ranks' status queries
(point-to-point on a private duplicate of the job's communicator, so nothing the training loop sends
is matched by it) and, once this rank has waited past the limit, asks every rank where it is, waits
``grace`` seconds, prints one report and calls ``MPI_Abort`` (exit 4). Only the lowest-numbered rank
blocked in a collective reports; the others defer to it (or to a rank that already reported) and
abort themselves only if its abort does not arrive. A rank that does not answer (dead, stopped)
ends the job before the limit: asked once :data:`SIGNAL_GRACE` s after a stop signal (which the
blocked main thread cannot act on), or, in a ``slack`` region, asked every ``timeout`` s past the
plain limit and silent twice in a row. Asking needs MPI_THREAD_MULTIPLE (requested by
:mod:`hpctrain.runtime`); with less, the watchdog still aborts with this rank's view only.
A collective task of a thread of its own (a checkpoint written in the background) is watched
beside the main thread's collective (:meth:`Watchdog.watch_background`): past its limit, the lowest
rank still in it reports.
Why and when: docs/reliability.md.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

from ..errors import EXIT_STALLED
from .signals import signals_seen
from .stall_report import diagnose, diagnose_background, ranks_text

TAG_QUERY, TAG_REPLY = 7101, 7102
SIGNAL_GRACE = 3.0  # s in one collective after a stop signal before the other ranks are asked


@dataclass(frozen=True)
class Region:
    """One blocking collective as the main thread entered it (``seq`` counts them; equal on every rank)."""

    seq: int
    what: str
    detail: str
    t0: float
    limit: float
    step: int = -1

    def describe(self) -> str:
        return f"{self.what}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class _Status:
    """What a rank answers when asked: where its main thread is."""

    rank: int
    seq: int
    inside: bool          # in region ``seq`` now (else: ``seq`` is the last one it left)
    where: str
    seconds: float        # in it, or since leaving it
    step: int = -1
    extra: dict = field(default_factory=dict)
    reported: bool = False  # this rank's watchdog has printed its report and called abort
    query: int = 0          # which ask of the asking rank this answers
    background: str = ""    # the background task it is in ("": none)


class Watchdog:
    """Per-rank stall detector; collective to build (``comm.Dup``), every rank of ``comm`` must make one.

    ``timeout`` seconds (0 = off) is the limit of a ``watch`` region; ``slack``
    multiplies it for regions that do real work besides waiting (checkpoint
    saves and loads, evaluation). ``abort`` ends the job (``comm.Abort`` by
    default; tests substitute a recorder).
    """

    def __init__(self, comm, timeout: float, log=None, abort=None):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        self.enabled = self.timeout > 0 and self.size > 1
        self.poll = min(1.0, max(0.05, self.timeout / 10))
        self.grace = min(10.0, max(1.0, self.timeout / 2))
        self._world = comm
        self._comm = comm.Dup() if self.enabled else None  # collective: every rank builds its watchdog
        self._abort = abort or (lambda code: comm.Abort(code))
        self._seq = 0
        self._region: Region | None = None
        self._last: tuple[int, str, float] = (0, "start-up", time.monotonic())
        self._thread = None
        self._stop = threading.Event()
        self._sends: list = []
        self.fired: str | None = None   # the diagnostic, once printed (tests read it)
        self._deferred_until = None
        self._signal = None          # (name, monotonic time) of the last stop signal seen by the thread
        self._signal_asked = None    # the region whose ranks were asked after it
        self._alive_asked = (0, 0.0)  # (region, time) of the last "does every rank still answer?"
        self._queries = 0             # asks made (their number travels with the query and its answer)
        self._background: Region | None = None   # the background task in flight (watch_background)
        self._background_deferred = None         # (region, deadline): a lower rank is to report it
        self.can_ask = self.enabled and _thread_multiple()
        if self._comm is not None:
            from mpi4py import MPI

            self._mpi = MPI
            self._comm.Set_errhandler(MPI.ERRORS_RETURN)  # a dead peer is "no answer", not a second abort

    # ---- main thread ------------------------------------------------------------
    def watch(self, what: str, detail: str = "", step: int = -1, slack: float = 1.0):
        """Context manager around one blocking collective (main thread only)."""
        return _Watch(self, what, detail, step, slack)

    def watch_background(self, what: str, detail: str = "", step: int = -1, slack: float = 1.0):
        """Context manager around a collective task of a thread of its own (at most one at a time),
        e.g. a checkpoint written in the background: every rank runs the same one, outside the main
        thread's sequence of collectives. Past ``slack`` x the timeout, the lowest rank still in it
        reports and ends the job; while it runs, a report on the main thread mentions it."""
        return _BackgroundWatch(self, Region(0, what, detail, 0.0, self.timeout * slack, step))

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the thread (at the end of a run); pending queries are simply left unanswered."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    # ---- the thread ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                for name in signals_seen():
                    self._signal = (name, time.monotonic())
                self._answer_queries()
                self._check()
                self._check_background()
            except Exception as exc:  # noqa: BLE001 - a broken watchdog must not kill training
                print(f"[rank {self.rank}] hpctrain: watchdog stopped: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
                return

    def _status(self) -> _Status:
        now, r = time.monotonic(), self._region
        reported = self.fired is not None
        b = self._background
        background = b.describe() if b is not None else ""
        if r is not None:
            return _Status(self.rank, r.seq, True, r.describe(), now - r.t0, r.step, reported=reported,
                           background=background)
        seq, where, t_end = self._last
        return _Status(self.rank, seq, False, where, now - t_end, reported=reported, background=background)

    def _answer_queries(self) -> None:
        if not self.can_ask:
            return
        while True:
            status = self._mpi.Status()
            msg = self._comm.improbe(tag=TAG_QUERY, status=status)
            if msg is None:
                break
            source = status.Get_source()
            answer = self._status()
            answer.query = msg.recv()
            self._sends.append(self._comm.isend(answer, dest=source, tag=TAG_REPLY))
        self._sends = [req for req in self._sends if not req.Test()]

    def _check(self) -> None:
        r = self._region
        if r is None or self.fired is not None:
            return
        waited = time.monotonic() - r.t0
        if self._deferred_until is not None:
            seq, deadline, note = self._deferred_until
            if seq != r.seq:
                self._deferred_until = None  # it completed after all: not a stall
            elif time.monotonic() >= deadline:
                if note is None:  # past the limit: the lowest waiting rank did not end the job
                    self._fire(r, self._ask(r), waited)
                else:  # deferred after a silence: only if it lasts, and nobody reported meanwhile
                    self._deferred_until = None
                    replies = self._ask(r)
                    silent = self._silent(replies)
                    if self._region is r and silent and not any(s.reported for s in replies.values()):
                        self._fire(r, replies, time.monotonic() - r.t0, note(silent))
            return
        if waited < r.limit:
            if self.can_ask and self._signal is not None and self._signal_asked != r.seq:
                self._check_after_signal(r)
            elif self.can_ask and r.limit > self.timeout and waited >= self.timeout and (
                    self._alive_asked[0] != r.seq or time.monotonic() - self._alive_asked[1] >= self.timeout):
                self._check_alive(r)
            return
        replies = self._ask(r)
        if self._region is not r:
            return  # completed while we asked
        # one report: from the lowest rank that is inside a collective (this one, or the one
        # after it when a rank passed this collective and waits in the next), unless a rank
        # has reported already (it entered earlier, or its wait passed the limit first)
        blocked = [self.rank] + [s.rank for s in replies.values() if s.inside]
        if min(blocked) == self.rank and not any(s.reported for s in replies.values()):
            self._fire(r, replies, time.monotonic() - r.t0)
        else:  # that rank reports when its own wait passes the limit (it may have entered later)
            self._deferred_until = (r.seq, time.monotonic() + r.limit + 2 * self.grace, None)

    def _check_background(self) -> None:
        """The background task past its limit: ask; the lowest rank still in it reports (or this
        one, 2 x grace later, if that one did not and nobody else did)."""
        b = self._background
        if b is None or self.fired is not None or time.monotonic() - b.t0 < b.limit:
            return
        deferred = self._background_deferred
        if deferred is not None and deferred[0] is b and time.monotonic() < deferred[1]:
            return
        replies = self._ask(b)
        if self._background is not b or any(s.reported for s in replies.values()):
            return
        inside = [self.rank] + [s.rank for s in replies.values() if s.background == b.describe()]
        if min(inside) == self.rank or deferred is not None and deferred[0] is b:
            self._report(diagnose_background(b, time.monotonic() - b.t0, self.rank, self.size, replies,
                                             self.grace, self.can_ask))
        else:
            self._background_deferred = (b, time.monotonic() + 2 * self.grace)

    def _check_after_signal(self, r: Region) -> None:
        """Still in ``r`` SIGNAL_GRACE s after a stop signal: ask once; a silent rank ends the job now."""
        name, t_signal = self._signal
        if time.monotonic() - max(r.t0, t_signal) < SIGNAL_GRACE:
            return
        self._signal_asked = r.seq
        self._end_if_silent(r, lambda silent: (
            f"  {name} arrived {time.monotonic() - t_signal:.1f} s ago, and the save it asks for needs every "
            f"rank: ending the job now instead of waiting for dist.comm_timeout or the launcher's kill"))

    def _check_alive(self, r: Region) -> None:
        """In a long region (a save, a load, evaluation, start-up: ``slack`` x the timeout), every
        ``timeout`` s past the first: ask; a silent rank (dead, stopped, on a lost node) ends the job
        now, since the region cannot complete without it, instead of at its limit."""
        self._alive_asked = (r.seq, time.monotonic())
        self._end_if_silent(r, lambda silent: (
            f"  {ranks_text(silent)} did not answer within {self.grace:g} s, and {r.what} cannot complete "
            f"without {'it' if len(silent) == 1 else 'them'}: ending the job now instead of at its limit "
            f"({r.limit:g} s, which leaves time for the work it does)"), asks=2)  # one missed grace is no loss

    def _end_if_silent(self, r: Region, note, asks: int = 1) -> None:
        """Ask every rank, up to ``asks`` times while one is silent; if one is silent every time,
        report (the lowest rank waiting) with ``note(silent)``."""
        for _ in range(asks):
            replies = self._ask(r)
            if self._region is not r:
                return  # completed while we asked: a live collective
            silent = self._silent(replies)
            if not silent:
                return
        blocked = [self.rank] + [s.rank for s in replies.values() if s.inside]
        if min(blocked) == self.rank and not any(s.reported for s in replies.values()):
            self._fire(r, replies, time.monotonic() - r.t0, note(silent))
        else:  # the lowest waiting rank reports; if it does not, ask once more then
            self._deferred_until = (r.seq, time.monotonic() + 2 * self.grace, note)

    def _silent(self, replies) -> list[int]:
        return [q for q in range(self.size) if q != self.rank and q not in replies]

    def _ask(self, r: Region) -> dict[int, _Status]:
        """Every other rank's status, as far as it answers within ``grace`` seconds."""
        if not self.can_ask:
            return {}
        replies: dict[int, _Status] = {}
        self._queries += 1
        for dest in range(self.size):
            if dest != self.rank:
                try:
                    self._sends.append(self._comm.isend(self._queries, dest=dest, tag=TAG_QUERY))
                except self._mpi.Exception:  # a peer whose process is gone: it will not answer
                    pass
        deadline = time.monotonic() + self.grace
        while len(replies) < self.size - 1 and time.monotonic() < deadline:
            msg = self._comm.improbe(tag=TAG_REPLY)
            if msg is None:
                self._answer_queries()  # others may be asking us at the same time
                time.sleep(0.02)
                continue
            status = msg.recv()
            if status.query == self._queries:  # not a late answer to an earlier ask
                replies[status.rank] = status
        self._answer_queries()  # a rank that asked while we collected must hear from us before we act
        return replies

    def _fire(self, r: Region, replies: dict[int, _Status], waited: float, note: str = "") -> None:
        text = diagnose(r, waited, self.rank, self.size, replies, self.grace, self.can_ask)
        b = self._background
        if b is not None:
            text += (f"\n  meanwhile this rank's {b.describe()} has run for {time.monotonic() - b.t0:.1f} s "
                     f"(the previous checkpoint stays the newest valid one)")
        self._report(text + ("\n" + note if note else ""))

    def _report(self, text: str) -> None:
        """Print the report (once) and end the job."""
        self.fired = text
        print("\n".join(f"[rank {self.rank}] {line}" for line in self.fired.splitlines()), file=sys.stderr,
              flush=True)
        self._abort(EXIT_STALLED)
        # the thread goes on answering (reported = True) until the abort ends this process: a rank
        # whose wait passes the limit later must hear that the report is made, not miss this rank


class _Watch:
    __slots__ = ("wd", "region")

    def __init__(self, wd: Watchdog, what, detail, step, slack):
        self.wd = wd
        wd._seq += 1
        self.region = Region(wd._seq, what, detail, 0.0, wd.timeout * slack, step)

    def __enter__(self):
        r = self.region
        self.wd._region = Region(r.seq, r.what, r.detail, time.monotonic(), r.limit, r.step)
        return self

    def __exit__(self, *exc):
        wd = self.wd
        wd._last = (self.region.seq, self.region.describe(), time.monotonic())
        wd._region = None
        return False


class _BackgroundWatch:
    __slots__ = ("wd", "region")

    def __init__(self, wd: Watchdog, region: Region):
        self.wd, self.region = wd, region

    def __enter__(self):
        r = self.region
        self.wd._background = Region(r.seq, r.what, r.detail, time.monotonic(), r.limit, r.step)
        return self

    def __exit__(self, *exc):
        self.wd._background = None
        return False


def _thread_multiple() -> bool:
    from mpi4py import MPI

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE

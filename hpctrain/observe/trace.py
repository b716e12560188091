"""Per-rank timelines in Chrome's trace-event format (open in Perfetto or chrome://tracing).

``train --trace DIR`` (``train.trace``) makes every rank write ``DIR/trace-rank<r>.json`` when
training ends; ``python -m hpctrain trace merge DIR -o FILE`` joins them, a track per rank. Spans
(``ph: "X"``): the step, its phases (data, forward, backward, ``allreduce wait`` and optimizer per
bucket, checkpoint), forward and backward per layer, and one per bucket reduced (``comm bucket i``;
args: strategy, compress, bytes); instant events (``ph: "i"``) when a bucket becomes ready.
``pid`` is the rank, ``tid`` 0 for the main thread and 1 for the communication thread.

Clock: ``time.perf_counter`` (that of :class:`~hpctrain.observe.log.Timers`), in microseconds since
every rank left one ``MPI_Barrier`` when the trainer was built (:meth:`Tracer.start`), so ranks share
a time base up to that barrier's exit skew; ``otherData.t0_unix`` is ``time.time()`` then. Off, the
trainer holds no tracer and each hook is one ``if ... is not None``; on a GPU the per-layer spans
synchronise the device, so trace to see where time goes, not to time a run. Only the first
``max_events`` events are kept; later ones are counted in ``otherData.dropped_events``.
Costs: docs/design.md, "Timelines".
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import sys
import threading
import time
from contextlib import contextmanager

from .log import Timers

MAX_EVENTS = 500_000
FILE_PATTERN = "trace-rank{rank:05d}.json"
THREAD_NAMES = {"MainThread": "main", "hpctrain-comm": "comm"}
PHASE_NAMES = {"allreduce": "allreduce wait"}  # the timer phase is the exposed wait, not the reduction


class Tracer:
    """Events of one rank, kept in memory and written by :meth:`save`; :meth:`start` (collective)
    sets the time base the ranks share."""

    def __init__(self, directory: str, world, sync=None, max_events: int = MAX_EVENTS):
        self.directory, self.rank, self.size = directory, world.rank, world.size
        self.sync = sync  # device.synchronize, called before a per-layer span ends
        self.max_events, self.dropped = max_events, 0
        self.events: list[tuple] = []  # (ph, name, cat, tid, start_s, dur_s, args)
        self._tids: dict[int, int] = {}
        self._names: dict[int, str] = {}
        self.t0 = time.perf_counter()
        self.t0_unix = time.time()

    def start(self, comm) -> None:
        """The common time base: every rank of ``comm`` leaves one barrier at about the same instant
        and reads its clock. Collective; before any event is recorded."""
        comm.Barrier()
        self.t0 = time.perf_counter()
        self.t0_unix = time.time()

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            tid = self._tids.setdefault(ident, len(self._tids))
            name = threading.current_thread().name
            self._names[tid] = THREAD_NAMES.get(name, name)
        return tid

    def _add(self, event: tuple) -> None:
        if len(self.events) < self.max_events:
            self.events.append(event)
        else:
            self.dropped += 1

    def complete(self, name: str, start: float, cat: str = "", args: dict | None = None,
                 end: float | None = None, sync: bool = False) -> None:
        """A span on the calling thread from ``start`` to ``end`` (perf_counter seconds; default now).
        ``sync``: wait for the device first (per-layer spans on a GPU)."""
        if sync and self.sync is not None:
            self.sync()
        end = time.perf_counter() if end is None else end
        self._add(("X", name, cat, self._tid(), start, end - start, args))

    def instant(self, name: str, cat: str = "", args: dict | None = None) -> None:
        self._add(("i", name, cat, self._tid(), time.perf_counter(), 0.0, args))

    @contextmanager
    def span(self, name: str, cat: str = "", args: dict | None = None):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, t0, cat, args)

    def to_json(self) -> dict:
        """The trace as a Chrome trace-event JSON object (timestamps in microseconds)."""
        us = lambda t: round(1e6 * (t - self.t0), 3)  # noqa: E731
        out = [{"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0,
                "args": {"name": f"rank {self.rank} ({socket.gethostname()})"}},
               {"ph": "M", "name": "process_sort_index", "pid": self.rank, "tid": 0, "args": {"sort_index": self.rank}}]
        out += [{"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid, "args": {"name": name}}
                for tid, name in sorted(self._names.items())]
        for ph, name, cat, tid, start, dur, args in self.events:
            e = {"ph": ph, "name": name, "cat": cat or "hpctrain", "pid": self.rank, "tid": tid, "ts": us(start)}
            if ph == "X":
                e["dur"] = round(1e6 * dur, 3)
            else:
                e["s"] = "t"  # an instant on its thread's track
            if args:
                e["args"] = args
            out.append(e)
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"rank": self.rank, "size": self.size, "host": socket.gethostname(),
                              "t0_unix": self.t0_unix, "clock": "perf_counter after a common MPI_Barrier",
                              "dropped_events": self.dropped}}

    def save(self) -> str:
        path = os.path.join(self.directory, FILE_PATTERN.format(rank=self.rank))
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.to_json(), fh, separators=(",", ":"))
        os.replace(tmp, path)
        return path


class TracedTimers(Timers):
    """:class:`~hpctrain.observe.log.Timers` that also records each phase as a span (the trainer's
    timers when tracing is on; the plain class otherwise, so tracing off costs nothing)."""

    def __init__(self, tracer: Tracer, sync=None, ranges=None):
        super().__init__(sync=sync, ranges=ranges)
        self.tracer = tracer

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            with super().__call__(phase):
                yield
        finally:
            self.tracer.complete(PHASE_NAMES.get(phase, phase), t0, "phase")


def make_trace_dir(directory: str) -> None:
    """Create ``directory`` or raise a ConfigError naming the fix (called on every rank)."""
    from ..errors import ConfigError

    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"train.trace={directory!r} cannot be written ({exc.strerror or exc}); "
                          f"choose a writable directory or set train.trace = \"\"") from None


def merge(directory: str, out: str) -> tuple[int, int]:
    """Join ``directory``'s per-rank traces into ``out`` (one process track per rank).
    Returns (ranks, events). Raises ValueError when there is nothing to merge."""
    files = sorted(glob.glob(os.path.join(directory, "trace-rank*.json")),
                   key=lambda p: int(re.findall(r"(\d+)\.json$", p)[0]))
    if not files:
        raise ValueError(f"no trace-rank*.json in {directory!r}; train with --trace {directory} first")
    events, meta = [], []
    for path in files:
        with open(path) as fh:
            doc = json.load(fh)
        events += doc["traceEvents"]
        meta.append(doc.get("otherData", {}))
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0)))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": meta}}, fh,
                  separators=(",", ":"))
    return len(files), sum(e["ph"] != "M" for e in events)


def cmd_merge(args) -> int:
    """``python -m hpctrain trace merge DIR [-o FILE]``."""
    out = args.output or os.path.join(args.dir, "trace.json")
    try:
        ranks, n = merge(args.dir, out)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as exc:
        print(f"hpctrain: error: trace merge: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {out}: {ranks} rank(s), {n:,} events (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0

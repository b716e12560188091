"""Rank-0 output: messages, the progress line, per-step metrics (JSON lines), timers.

Only rank 0 writes anything; other ranks get no-op writers, so call sites
need no ``if rank == 0``. On a terminal the progress line rewrites itself in
place; in a batch log (non-TTY, or under a launcher, whose pseudo-terminal
lies; ``HPCTRAIN_PROGRESS=tty|lines`` overrides) it prints one full line every
``log_every`` steps so ``tail -f slurm-*.out`` stays readable.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager


class Log:
    """Messages from rank 0 only, flushed at once (batch logs are buffered otherwise)."""

    def __init__(self, is_root: bool, stream=None):
        self.enabled = is_root
        self.stream = stream or sys.stdout
        self.tty = self.enabled and _interactive(self.stream)
        self._pending_cr = False

    def info(self, msg: str) -> None:
        if not self.enabled:
            return
        if self._pending_cr:
            self.stream.write("\n")
            self._pending_cr = False
        self.stream.write(msg + "\n")
        self.stream.flush()

    def warn(self, msg: str) -> None:
        """A warning from rank 0, to stderr's neighbour: the same stream, prefixed."""
        self.info(f"hpctrain: warning: {msg}")

    def progress(self, msg: str) -> None:
        """A line that overwrites itself on a TTY and is a plain line otherwise."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\033[K" + msg)
            self._pending_cr = True
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()


def _interactive(stream) -> bool:
    """True when progress may rewrite one line in place.

    mpirun hands ranks a pseudo-terminal even when its own output goes to a
    batch log, so under a launcher isatty() lies; HPCTRAIN_PROGRESS=tty|lines
    decides explicitly.
    """
    choice = os.environ.get("HPCTRAIN_PROGRESS", "")
    if choice in ("tty", "lines"):
        return choice == "tty"
    launched = any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"))
    return not launched and stream.isatty()


def format_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Metrics:
    """Per-step metrics as JSON lines, written by rank 0 (no-op elsewhere or when path is empty).

    The file is opened (and so checked writable) at start-up without touching
    its contents; :meth:`begin` then empties it for a fresh start (never appending
    to an older run's steps) or, for a run resumed at step s, keeps the records of
    steps 1..s and drops later ones (a failed attempt wrote them; the resumed run
    writes them again), so the file holds every step exactly once. Records go
    through a buffer; :meth:`sync` (the run loop calls it with every checkpoint)
    and :meth:`close` make them durable (flush and fsync), so a crash loses no
    record of a step a checkpoint holds.
    """

    def __init__(self, path: str, is_root: bool):
        self._fh = None
        self.path = path
        if path and is_root:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self._fh = open(path, "a", buffering=1 << 16)
            except OSError as exc:
                from ..errors import ConfigError

                raise ConfigError(f"train.metrics={path!r} cannot be written ({exc.strerror or exc}); "
                                  f"choose a writable path or set train.metrics = \"\"") from None

    def begin(self, resumed_step: int | None) -> None:
        """A fresh start (None): the file starts empty. Resumed at step ``resumed_step``: the records
        up to that step stay, the first record of a later step (or a line a crash cut short) and
        everything after it go."""
        if self._fh is None:
            return
        keep = 0
        if resumed_step is not None:
            with open(self.path, "rb") as fh:
                for line in fh:
                    try:
                        if not line.endswith(b"\n") or json.loads(line)["step"] > resumed_step:
                            break
                    except (ValueError, KeyError, TypeError):
                        break
                    keep += len(line)
        self._fh.seek(keep)
        self._fh.truncate()

    def write(self, **record) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record) + "\n")

    def sync(self) -> None:
        """Every record written so far on disk (flush and fsync)."""
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self.sync()
            self._fh.close()
            self._fh = None


class Timers:
    """Wall-clock seconds per phase (data, forward, backward, allreduce, optimizer).

    ``with timers("forward"): ...`` adds to the phase; :meth:`pop` returns and
    clears the totals, so a caller can take per-step or per-window splits.
    ``sync`` (the device's synchronize) runs at the end of each phase so that
    asynchronous GPU work is charged to the phase that queued it. ``ranges`` (an
    :class:`~hpctrain.observe.nvtx.NvtxRanges`, ``train.nvtx``): each phase is also an NVTX range.
    """

    def __init__(self, sync=None, ranges=None):
        self.totals = defaultdict(float)
        self.sync, self.ranges = sync, ranges

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        if self.ranges is not None:
            self.ranges.push(phase)
        try:
            yield
            if self.sync is not None:
                self.sync()
        finally:
            if self.ranges is not None:
                self.ranges.pop()
            self.totals[phase] += time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()
        return out

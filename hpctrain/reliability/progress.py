"""How far a run got, for the launcher that supervises it: ``HPCTRAIN_LAUNCH_PROGRESS=FILE``.

Rank 0 writes one fixed-width line per phase into FILE (one ``pwrite`` at the
phase's offset, no fsync: a crash of the run does not lose what the kernel
already has; under srun FILE is in the shared submit folder), at three moments:

  start  the trainer begins its start-up (MPI is up), step 0
  ready  the checkpoint is loaded, or the run starts fresh: the step it starts from
  step   a global step completed (its number, as in the metrics)

``python -m hpctrain launch`` reads it to say how many steps a failure cost
(the failed run's last step minus the step its restart resumed at) and how
long the restart took to its first new step, split into start-up, checkpoint
load and first step. Unset (the normal case) nothing is written.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ENV = "HPCTRAIN_LAUNCH_PROGRESS"  # not HPCTRAIN_PROGRESS: that one picks the progress display (log.py)
PHASES = ("start", "ready", "step")   # each has its own line in the file, so no mark hides another
_WIDTH = 40  # "phase step unix-time", padded: every write replaces its whole line


@dataclass(frozen=True)
class Mark:
    phase: str     # start | ready | step
    step: int
    time: float    # time.time() when it was written


class Progress:
    """Writes the marks of this run on rank 0 when ``HPCTRAIN_LAUNCH_PROGRESS`` names a file."""

    def __init__(self, is_root: bool, path: str | None = None):
        path = os.environ.get(ENV, "") if path is None else path
        self._fd = None
        if path and is_root:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError:
                self._fd = None  # a supervisor's bookkeeping must never stop a run

    def mark(self, phase: str, step: int) -> None:
        if self._fd is None:
            return
        line = f"{phase} {step} {time.time():.6f}".ljust(_WIDTH - 1) + "\n"
        try:
            os.pwrite(self._fd, line.encode(), PHASES.index(phase) * _WIDTH)
        except OSError:
            pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read(path: str) -> dict:
    """The marks in ``path`` by phase ({} when there is no file yet)."""
    try:
        with open(path) as fh:
            text = fh.read(len(PHASES) * _WIDTH)
    except OSError:
        return {}
    marks = {}
    for at in range(0, len(text), _WIDTH):
        fields = text[at:at + _WIDTH].split()
        try:
            marks[fields[0]] = Mark(fields[0], int(fields[1]), float(fields[2]))
        except (IndexError, ValueError):
            continue
    return marks

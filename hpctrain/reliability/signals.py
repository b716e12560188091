"""SIGUSR1 / SIGTERM: finish the current step, save a checkpoint, exit with EXIT_CHECKPOINTED.

The handler only records the signal; the training loop reads :attr:`StopSignal.pending`
at each step boundary and the ranks agree through the per-step statistics
all-reduce they run anyway, so a signal that reaches only some ranks (a
``kill`` to one pid, a launcher forwarding to one node) stops every rank at
the same step.
"""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = ("SIGUSR1", "SIGTERM")
_wakeup: tuple[int, int] | None = None   # (read end, write end) of the signal pipe, once installed


def install_wakeup() -> None:
    """Main thread: the C-level handler also writes each caught signal's number to a pipe.

    Python runs a handler only when the main thread returns to the interpreter,
    so a rank blocked in an MPI collective (waiting for a dead peer) never sees
    its SIGTERM; the watchdog thread reads the pipe (:func:`signals_seen`) and
    can end the job at once instead of leaving it to the launcher's kill
    (SLURM's KillWait). Left alone if something else uses the wakeup fd.
    """
    global _wakeup
    if _wakeup is not None:
        return
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(r)
        os.close(w)
        return
    if old != -1:  # another user of the wakeup fd (an event loop): theirs stays
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    _wakeup = (r, w)


def signals_seen() -> list[str]:
    """Names of the stop signals caught since the last call (any thread; [] before install_wakeup)."""
    if _wakeup is None:
        return []
    try:
        data = os.read(_wakeup[0], 512)
    except (BlockingIOError, OSError):
        return []
    names = {getattr(signal, n).value: n for n in STOP_SIGNALS}
    return [names[b] for b in data if b in names]


class StopSignal:
    """Installs the handlers on ``__enter__`` (main thread only) and restores the old ones on exit."""

    def __init__(self):
        self.received: str | None = None
        self._old: dict = {}

    @property
    def pending(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __enter__(self):
        install_wakeup()
        for name in STOP_SIGNALS:
            sig = getattr(signal, name)
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def ignore_late(self) -> None:
        """After the last step: ignore further stop signals (the CLI calls this once the run returned).

        Python restores the default action (termination) while it shuts down, and
        MPI_Finalize may wait for slower ranks meanwhile; a signal arriving then, such
        as SLURM's time-limit warning just after a run finished, would turn exit
        code 0 or 75 into death by signal (measured: exit 138 after a finished run).
        """
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        return False

"""SIGUSR1 / SIGTERM: finish the current step, save a checkpoint, exit with EXIT_CHECKPOINTED.

The handler only records the signal; the training loop reads :attr:`StopSignal.pending`
at each step boundary and the ranks agree through the per-step statistics
all-reduce they run anyway, so a signal that reaches only some ranks (a
``kill`` to one pid, a launcher forwarding to one node) stops every rank at
the same step.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = ("SIGUSR1", "SIGTERM")


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

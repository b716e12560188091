"""Saves written by a thread of their own (``checkpoint.async_save``), beside the training thread.

A :class:`BackgroundSave` runs one save's write, check and commit in the thread
"hpctrain-checkpoint-writer" on :func:`duplicate` communicators (its collectives never pair with
the training thread's); that needs MPI_THREAD_MULTIPLE (:func:`threads_may_call_mpi`). A run that
ends by an error lets the writers finish first (:func:`finish_background_saves`, called on the way
out by ``python -m hpctrain``). When and how: :mod:`.manager`, docs/checkpoint-format.md.
"""

from __future__ import annotations

import contextlib
import threading
import time


_IN_FLIGHT: "set[BackgroundSave]" = set()   # saves whose writer thread runs (the writer removes its own)
_IN_FLIGHT_LOCK = threading.Lock()


def finish_background_saves(say=None, timeout: float = 300.0) -> None:
    """The last resort of a process ending by an error outside the run loop (the loop itself waits,
    watched, for its save in flight before it stops its watchdog): wait up to ``timeout`` s for the
    writer threads still running, so a save every rank is writing commits before the exit.
    ``say(line)``: where to tell the user it waits."""
    with _IN_FLIGHT_LOCK:
        running = list(_IN_FLIGHT)
    for pending in running:
        if say is not None:
            say(f"hpctrain: finishing the checkpoint of step {pending.step} (being written in the background) "
                f"before exiting")
        pending._thread.join(timeout)


class BackgroundSave:
    """A save written by a thread of its own (``checkpoint.async_save``): its step, when it started
    (perf_counter), how long it stalled training; :meth:`join` gives its path or raises its error."""

    def __init__(self, step: int, t0: float, stalled: float):
        self.step, self.t0, self.stalled = step, t0, stalled
        self.seconds, self._path, self._error, self._thread = 0.0, None, None, None

    def start(self, write, watch=None) -> None:
        def run():
            try:
                with watch() if watch is not None else contextlib.nullcontext():
                    self._path = write()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread at join
                self._error = exc
            self.seconds = time.perf_counter() - self.t0
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(self)
        self._thread = threading.Thread(target=run, name="hpctrain-checkpoint-writer", daemon=True)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(self)
        self._thread.start()

    def join(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._path


def threads_may_call_mpi(log) -> bool:
    """Whether MPI gives this process MPI_THREAD_MULTIPLE (a background writer calls MPI beside the
    training thread); else one warning, and saves stay synchronous."""
    from mpi4py import MPI

    if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        return True
    log.warn("checkpoint.async_save: this MPI does not give MPI_THREAD_MULTIPLE (e.g. Cray MPICH without "
             "MPICH_MAX_THREAD_SAFETY=multiple): checkpoints are saved synchronously")
    return False


def duplicate(world):
    """``world`` on duplicates of its communicators (collective over each)."""
    import dataclasses

    local = world.local_comm.Dup() if getattr(world, "local_comm", None) is not None else None
    return dataclasses.replace(world, comm=world.comm.Dup(), local_comm=local)

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
import weakref


_IN_FLIGHT: "weakref.WeakSet[BackgroundSave]" = weakref.WeakSet()   # saves whose writer thread runs


def finish_background_saves(say=None, timeout: float | None = None) -> None:
    """Wait for the writer threads of the saves still in flight (a run ending by an error: the writers
    of every rank go on, on their own communicators, so the save commits or fails before the job
    ends). ``say(line)``: where to tell the user it waits. The stall watchdog still watches the write."""
    for pending in list(_IN_FLIGHT):
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
            _IN_FLIGHT.discard(self)
        self._thread = threading.Thread(target=run, name="hpctrain-checkpoint-writer", daemon=True)
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

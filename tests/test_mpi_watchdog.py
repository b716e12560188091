"""The stall watchdog in process (run under mpirun -n 1..4): one late rank, one report.

The abort is replaced by a recorder, and the late rank joins after the report,
so the collective completes and the test can look at every rank's watchdog.
(A rank that cannot answer at all, SIGSTOP, is tested from outside in
test_faults.py.)"""

import threading
import time

import pytest

from hpctrain.reliability.watchdog import Watchdog

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


@pytest.fixture
def comm():
    from mpi4py import MPI

    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def _only_at(comm, *sizes, why):
    """These tests sleep past the watchdog's limits: each runs at the world sizes where it proves
    something the others do not."""
    if comm.size not in sizes:
        pytest.skip(f"runs at {' and '.join(map(str, sizes))} rank(s): {why}")


def _barrier_under_watchdog(comm, sleep_s: float, **where):
    """Sleep, then a Barrier watched with timeout 1 s (grace 1 s); every rank's (report, aborts)."""
    aborts = []
    wd = Watchdog(comm, timeout=1.0, abort=aborts.append)
    wd.start()
    try:
        time.sleep(sleep_s)
        with wd.watch("test barrier", **where):
            comm.Barrier()
    finally:
        wd.stop()
    return wd, comm.allgather(wd.fired), comm.allgather(aborts)


def test_a_late_rank_is_named_once_by_the_lowest_waiting_rank(comm):
    _only_at(comm, 1, 2, 3, why="no watchdog; one waiting rank; several (a fourth rank adds nothing)")
    late = comm.size - 1
    # the late rank is busy in Python (its watchdog still answers) past the limit and the grace
    # (one rank: nobody to be late for, so no sleep; the check is that no watchdog runs)
    wd, reports, codes = _barrier_under_watchdog(comm, 3.5 if comm.rank == late and comm.size > 1 else 0.0,
                                                 detail="bucket 2 of 3", step=7)
    if comm.size == 1:
        assert reports == [None] and not wd.enabled  # nobody to wait for: no watchdog
        return
    assert reports[0] is not None and reports[1:] == [None] * (comm.size - 1), reports
    assert codes[0] == [4] and all(c == [] for c in codes[1:])  # EXIT_STALLED, once
    text = reports[0]
    assert text.startswith("hpctrain: watchdog: test barrier (bucket 2 of 3) has not completed after")
    waiting = "rank 0" if comm.size == 2 else "ranks " + ", ".join(map(str, range(late)))
    assert f"waiting in it: {waiting}\n" in text, text
    assert f"rank {late}: not in a collective" in text
    assert "no answer" not in text


def test_a_rank_whose_wait_passes_the_limit_after_the_report_does_not_report_again(comm):
    """Rank 0 reports first; ranks 1.. enter 1 s later, and when their own limit passes they ask
    rank 0, which answers that it has reported: they defer (once its watchdog stopped answering,
    they reported too: no answer from rank 0 made them the lowest waiting rank)."""
    _only_at(comm, 3, why="needs an early rank, a later one and a late one (a fourth adds nothing)")
    # the late rank joins after every other rank's limit, before their deferrals end; the middle
    # ranks enter as rank 0's limit passes, so theirs passes after rank 0 reported
    sleep_s = 4.0 if comm.rank == comm.size - 1 else 1.0 if comm.rank > 0 else 0.0
    _, reports, codes = _barrier_under_watchdog(comm, sleep_s, step=3)
    assert reports[0] is not None and reports[1:] == [None] * (comm.size - 1), reports
    assert codes[0] == [4] and all(c == [] for c in codes[1:])


def test_a_collective_within_the_limit_is_not_reported(comm):
    aborts = []
    wd = Watchdog(comm, timeout=2.0, abort=aborts.append)
    wd.start()
    try:
        for step in range(3):
            if comm.rank == 0:
                time.sleep(0.3)  # a straggler, well within the limit
            with wd.watch("test allreduce", step=step):
                comm.allreduce(step)
    finally:
        wd.stop()
    assert comm.allgather(wd.fired) == [None] * comm.size and aborts == []


def test_off_when_the_timeout_is_zero(comm):
    wd = Watchdog(comm, timeout=0.0)
    assert not wd.enabled
    wd.start()
    with wd.watch("anything"):
        comm.Barrier()
    wd.stop()
    assert wd.fired is None


def test_a_silent_rank_ends_a_long_region_at_the_plain_limit_not_the_slack(comm):
    """A save-like region (slack 10: limit 10 s) where the last rank's watchdog cannot answer (its
    thread stopped: as a dead or stopped rank looks to the others): past the plain limit (1 s) the
    lowest waiting rank asks, hears nothing within the grace (1 s), asks again, hears nothing again
    and reports at ~3 s, naming the silent rank; the other waiting ranks defer to it, and when
    their deferral ends they find it has reported; a live straggler in the same kind of region is
    left alone (the next test)."""
    _only_at(comm, 3, why="two waiting ranks, one reports and one defers (a third adds nothing; one waiting rank "
                          "reports as the lowest does here)")
    silent = comm.size - 1
    aborts = []
    wd = Watchdog(comm, timeout=1.0, abort=aborts.append)
    wd.start()
    try:
        if comm.rank == silent:
            wd.stop()
            time.sleep(6.0)  # longer than the limit and two asks and a deferral, short of the 10 s limit
        with wd.watch("checkpoint save", "step 5", step=5, slack=10):
            comm.Barrier()
    finally:
        wd.stop()
    reports, codes = comm.allgather(wd.fired), comm.allgather(aborts)
    assert reports[0] is not None and reports[1:] == [None] * (comm.size - 1), reports
    assert codes[0] == [4] and all(c == [] for c in codes[1:])
    text = reports[0]
    waited = float(text.split("has not completed after ")[1].split(" s")[0])
    assert 2.5 <= waited < 5.0, text  # the plain limit and two graces, not 10 s
    assert "(limit 10 s: dist.comm_timeout)" in text, text
    assert f"no answer within 1 s from rank {silent}" in text, text
    assert f"rank {silent} did not answer within 1 s, and checkpoint save cannot complete without it" in text, text


def test_a_live_straggler_in_a_long_region_gets_the_slack(comm):
    """The same region with the last rank busy for 3.5 s but answering: asked at 1 s, 2 s and 3 s,
    every rank answers, nobody reports (the plain limit alone would have fired)."""
    _only_at(comm, 3, why="every waiting rank asks the straggler; at one rank no watchdog runs "
                          "(test_a_late_rank_... checks that)")
    aborts = []
    wd = Watchdog(comm, timeout=1.0, abort=aborts.append)
    wd.start()
    try:
        if comm.rank == comm.size - 1:
            time.sleep(3.5)
        with wd.watch("checkpoint save", "step 5", step=5, slack=10):
            comm.Barrier()
    finally:
        wd.stop()
    assert comm.allgather(wd.fired) == [None] * comm.size and aborts == []


def test_a_stalled_background_task_is_reported_once_while_training_goes_on(comm):
    """A checkpoint written by a thread of its own (limit 2 s here) where the last rank sits in it
    for 4.5 s; the training thread's collectives meanwhile complete in time. Past the limit the
    lowest rank still in the task reports it (its collectives alone would never fire); the other
    defers and, finding the report made, stays quiet."""
    _only_at(comm, 2, why="one rank reports and one defers (more ranks add nothing; one rank has no watchdog)")
    aborts, other = [], comm.Dup()
    wd = Watchdog(comm, timeout=1.0, abort=aborts.append)
    wd.start()

    def write():
        with wd.watch_background("checkpoint save", "step 5, in the background", 5, slack=2):
            if comm.rank == comm.size - 1:
                time.sleep(4.5)
            other.Barrier()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for step in range(8):
            with wd.watch("test allreduce", step=step):
                comm.allreduce(step)
            time.sleep(0.25)
        writer.join()
    finally:
        wd.stop()
        other.Free()
    reports, codes = comm.allgather(wd.fired), comm.allgather(aborts)
    assert reports[0] is not None and reports[1:] == [None] * (comm.size - 1), reports
    assert codes[0] == [4] and all(c == [] for c in codes[1:])
    text = reports[0]
    assert text.startswith("hpctrain: watchdog: checkpoint save (step 5, in the background) has not completed "
                           "after"), text
    waited = float(text.split("has not completed after ")[1].split(" s")[0])
    assert 2.0 <= waited < 3.5, text
    assert "still in it: ranks 0, 1" in text and "no answer" not in text, text

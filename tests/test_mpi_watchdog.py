"""The stall watchdog in process (run under mpirun -n 1..4): one late rank, one report.

The abort is replaced by a recorder, and the late rank joins after the report,
so the collective completes and the test can look at every rank's watchdog.
(A rank that cannot answer at all, SIGSTOP, is tested from outside in
test_faults.py.)"""

import time

import pytest

from hpctrain.watchdog import Watchdog

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


@pytest.fixture
def comm():
    from mpi4py import MPI

    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


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
    late = comm.size - 1
    # the late rank is busy in Python (its watchdog still answers) past the limit and the grace
    wd, reports, codes = _barrier_under_watchdog(comm, 3.5 if comm.rank == late else 0.0,
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
    if comm.size < 3:
        pytest.skip("needs an early rank, a later one and a late one")
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

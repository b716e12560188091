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


def test_a_late_rank_is_named_once_by_the_lowest_waiting_rank(comm):
    aborts = []
    wd = Watchdog(comm, timeout=1.0, abort=aborts.append)
    late = comm.size - 1
    wd.start()
    try:
        if comm.rank == late:
            time.sleep(1.0 + wd.grace + 1.5)  # busy in Python: its watchdog still answers
        with wd.watch("test barrier", "bucket 2 of 3", step=7):
            comm.Barrier()
    finally:
        wd.stop()
    reports = comm.allgather(wd.fired)
    codes = comm.allgather(aborts)
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

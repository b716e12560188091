"""Which thread reduces which bucket (hpctrain.comm.buckets.BucketedAllreduce), without MPI.

The last bucket is ready only when backward ends. When the communication
thread has nothing left by then, the main thread reduces it when the optimizer
waits for it (no hand-off); when an earlier bucket is still being reduced, the
last one queues behind it on the thread, since two threads must never run
collectives at once and the reduction should overlap the optimizer's updates of
the earlier buckets; so does a large last bucket on a rank with cores to spare.
"""

import threading
import types

import numpy as np
import pytest

from hpctrain.comm.buckets import Bucket, BucketedAllreduce

pytestmark = pytest.mark.timeout(60)


class RecordingStrategy:
    """Sums over 'ranks' by doubling (2 ranks holding the same gradient); records the calling thread.

    ``hold`` = a bucket index whose reduction blocks until ``release`` is set, so a test
    can keep it in flight while backward marks the last bucket ready."""

    def __init__(self, hold=None):
        self.calls, self.hold, self.release = [], hold, threading.Event()
        self.started = threading.Event()

    def __call__(self, view, op):
        index = int(view[0]) // 100   # each bucket's first value names it (see _setup)
        self.calls.append((index, threading.current_thread() is threading.main_thread()))
        if index == self.hold:
            self.started.set()
            assert self.release.wait(10), "the test never released the held bucket"
        view *= 2


def _setup(n_buckets, strategy, overlap=True):
    grad = np.zeros(4 * n_buckets)
    buckets = [Bucket(i, 4 * (n_buckets - 1 - i), 4 * (n_buckets - i), (f"p{i}",)) for i in range(n_buckets)]
    for b in buckets:
        grad[b.lo:b.hi] = 100 * b.index + np.arange(4)
    ops = types.SimpleNamespace(scale=lambda v, s: v.__imul__(s), all_finite=lambda v: bool(np.isfinite(v).all()))
    comm = BucketedAllreduce(strategy, grad, buckets, types.SimpleNamespace(ops=ops), overlap=overlap)
    return comm, grad, buckets


def _expected(buckets, n_buckets, scale):
    want = np.zeros(4 * n_buckets)
    for b in buckets:
        want[b.lo:b.hi] = (100 * b.index + np.arange(4)) * 2 * scale
    return want


def test_one_bucket_is_reduced_on_the_calling_thread():
    strategy = RecordingStrategy()
    comm, grad, buckets = _setup(1, strategy)
    comm.start(scale=0.5)
    comm.mark_ready("p0")
    assert strategy.calls == []           # nothing happens until the optimizer asks for it
    comm.wait(buckets[0])
    assert strategy.calls == [(0, True)]
    np.testing.assert_array_equal(grad, _expected(buckets, 1, 0.5))
    assert comm.comm_s > 0 and comm.exposed_s >= comm.comm_s


def test_last_bucket_is_inline_once_the_thread_is_idle():
    strategy = RecordingStrategy()
    comm, grad, buckets = _setup(3, strategy)
    for step in range(3):   # every step alike (the inline mark is per step)
        strategy.calls.clear()
        grad[:] = _expected(buckets, 3, 1.0) / 2
        comm.start(scale=1.0, step=step)
        comm.mark_ready("p0")
        comm.mark_ready("p1")
        for b in buckets[:2]:
            comm._done[b.index].wait(10)     # the thread has finished both
        comm.mark_ready("p2")
        comm.wait(buckets[0])
        assert len(strategy.calls) == 2   # the last one is reduced when it is waited for (watchdog label)
        for b in buckets[1:]:
            comm.wait(b)
        assert strategy.calls == [(0, False), (1, False), (2, True)]
        np.testing.assert_array_equal(grad, _expected(buckets, 3, 1.0))


def test_last_bucket_queues_behind_a_bucket_still_in_flight():
    strategy = RecordingStrategy(hold=0)
    comm, grad, buckets = _setup(2, strategy)
    comm.start(scale=0.25)
    comm.mark_ready("p0")
    assert strategy.started.wait(10)
    comm.mark_ready("p1")                  # bucket 0 is still being reduced on the thread
    strategy.release.set()
    for b in buckets:
        comm.wait(b)
    assert strategy.calls == [(0, False), (1, False)]   # both on the thread, in order
    np.testing.assert_array_equal(grad, _expected(buckets, 2, 0.25))


def test_no_collective_after_the_thread_failed():
    """A failure on the thread ends the step's collectives on this rank: the last bucket is not
    reduced inline after it (other ranks may never join that all-reduce: a hang)."""
    def flaky(view, op):
        strategy.calls.append((int(view[0]) // 100, threading.current_thread() is threading.main_thread()))
        if int(view[0]) // 100 == 0:
            raise ValueError("ranks passed different buffers")
        view *= 2

    strategy = types.SimpleNamespace(calls=[])
    comm, _, buckets = _setup(2, flaky)
    comm.start(scale=1.0)
    comm.mark_ready("p0")
    assert comm._done[0].wait(10)
    comm.mark_ready("p1")
    with pytest.raises(RuntimeError, match="failed on the communication thread"):
        for b in buckets:
            comm.wait(b)
    with pytest.raises(RuntimeError, match="failed on the communication thread"):
        comm.wait(buckets[1])
    assert strategy.calls == [(0, False)]


@pytest.mark.parametrize("cores, inline", [({0, 1}, False), ({0}, True)])
def test_a_large_last_bucket_stays_on_the_thread_when_there_are_cores_to_spare(monkeypatch, cores, inline):
    import hpctrain.comm.buckets as buckets_mod

    monkeypatch.setattr(buckets_mod, "INLINE_MAX_BYTES", 16)   # every bucket here is 32 bytes
    monkeypatch.setattr(buckets_mod.os, "sched_getaffinity", lambda pid: cores, raising=False)
    strategy = RecordingStrategy()
    comm, grad, buckets = _setup(2, strategy)
    comm.start(scale=1.0)
    comm.mark_ready("p0")
    assert comm._done[0].wait(10)
    comm.mark_ready("p1")
    for b in buckets:
        comm.wait(b)
    assert strategy.calls == [(0, False), (1, inline)]
    np.testing.assert_array_equal(grad, _expected(buckets, 2, 1.0))


def test_an_inline_failure_reaches_the_caller():
    def broken(view, op):
        raise RuntimeError("link down")

    comm, _, buckets = _setup(1, broken)
    comm.start(scale=1.0)
    comm.mark_ready("p0")
    with pytest.raises(RuntimeError, match="link down"):
        comm.wait(buckets[0])


def test_overlap_off_reduces_every_bucket_in_wait():
    strategy = RecordingStrategy()
    comm, grad, buckets = _setup(2, strategy, overlap=False)
    comm.start(scale=1.0)
    comm.mark_ready("p0")
    comm.mark_ready("p1")
    assert strategy.calls == []
    for b in buckets:
        comm.wait(b)
    assert strategy.calls == [(0, True), (1, True)]
    np.testing.assert_array_equal(grad, _expected(buckets, 2, 1.0))

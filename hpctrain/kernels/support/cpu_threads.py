"""The CPU twins' threads: an op split over the rank's share of the cores, the same bits at any count.

A CPU op runs its numba loops (all ``nogil``) and NumPy calls (BLAS and ufuncs release the GIL too)
on contiguous row ranges, one per thread (:func:`for_rows`, :func:`for_chunks`), in a pool of the
rank's threads; the calling thread runs the first range itself. How the work is split never changes
a result: rows computed independently (an elementwise op, a LayerNorm row, a softmax row, a batch
row's attention heads) are the same whichever thread computes them, and a sum over rows is taken in
fixed chunks of :data:`CHUNK_ROWS` rows, each chunk's float64 partial by one thread, the partials
added in chunk order (:func:`add_partials`). So a run gives the same bits with 1, 2 or 64 threads.

A pool of Python threads rather than numba's ``parallel=True``, because numba's fallback threading
layer (workqueue) aborts the process when two threads enter parallel regions at once, and the
communication thread runs CPU kernels while the main thread runs backward. The count is
:func:`set_threads`'s, else ``OMP_NUM_THREADS`` (the rank's share, set by
``runtime.limit_threads_per_rank``), resolved once at the first split op. An op whose estimated time
on one core (its stated ns per element) is under :data:`MIN_SPLIT_NS` runs on the calling thread: the
hand-off would cost more than it saves (docs/cpu.md). While an op is split, OpenBLAS runs one thread.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

CHUNK_ROWS = 128         # rows per partial sum of a reduction over rows (fixed: the bits depend on it)
MIN_SPLIT_NS = 200_000   # ops estimated under this on one core run on the calling thread (_parts)

_lock = threading.Lock()
_threads = None          # None: not yet resolved (default_threads, once, at the first use)
_pool = None


def default_threads() -> int:
    """The rank's share: ``OMP_NUM_THREADS`` (set by runtime.limit_threads_per_rank or the user),
    else the cores this process may run on."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", "0"))
    except ValueError:
        n = 0
    return max(1, n or len(cpus()))


def cpus() -> set:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def threads() -> int:
    """How many threads a CPU op is split over: :func:`set_threads`'s count, else
    :func:`default_threads` read once, at the first call (every op asks; the environment is not
    read again)."""
    global _threads
    n = _threads
    if n is None:
        with _lock:
            if _threads is None:
                _threads = default_threads()
            n = _threads
    return n


def set_threads(n: int | None) -> None:
    """Split CPU ops over ``n`` threads from now on; None: :func:`default_threads` again, read anew
    at the next op (after a change of ``OMP_NUM_THREADS``, say). The pool keeps its workers (a split
    takes as many as it needs), so an op running in another thread is never left with a pool that
    stopped."""
    global _threads
    with _lock:
        _threads = None if n is None else max(1, int(n))


def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering 0..n in ``parts`` contiguous pieces of sizes differing by one at most."""
    parts = max(1, min(parts, n))
    q, r = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + q + (1 if i < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _parts(elements: int, ns_per_element: float) -> int:
    """Threads an op is split over: all the rank's, unless its estimated time on one thread is
    under MIN_SPLIT_NS (then the calling thread alone: the hand-off would cost more than it saves)."""
    return threads() if elements * ns_per_element >= MIN_SPLIT_NS else 1


def for_rows(fn, rows: int, elements: int, ns_per_element: float = 1.0) -> None:
    """``fn(lo, hi)`` over row ranges covering 0..rows, one range per thread (on the calling thread
    alone for a small op: :func:`_parts`). ``fn`` must compute each row alone. ``ns_per_element``:
    the op's time per element on one core (measured), which says whether splitting pays."""
    parts = ranges(rows, _parts(elements, ns_per_element))
    if len(parts) == 1:
        fn(0, rows)
        return
    _run(fn, parts)


def chunks_of(rows: int) -> int:
    """How many chunks of CHUNK_ROWS rows cover ``rows`` (the partial sums a reduction keeps)."""
    return max(1, -(-rows // CHUNK_ROWS))


def for_chunks(fn, rows: int, elements: int, ns_per_element: float = 1.0) -> int:
    """``fn(c0, c1)`` over contiguous ranges of the chunks of CHUNK_ROWS rows covering 0..rows (chunk
    c is rows c * CHUNK_ROWS up to the next chunk or ``rows``), one range per thread; returns the
    chunk count (:func:`chunks_of`). ``fn`` writes chunk c's partial result to its slot c (one
    kernel call loops over its range's chunks: no Python call per chunk); the caller adds the
    slots in order (:func:`add_partials`), so the result does not depend on the thread count."""
    chunks = chunks_of(rows)
    parts = ranges(chunks, _parts(elements, ns_per_element))
    if len(parts) <= 1:
        fn(0, chunks)
    else:
        _run(fn, parts)
    return chunks


def _run(fn, parts) -> None:
    pool = _get_pool(len(parts) - 1)
    with _blas.single():
        pending = [pool.submit(fn, lo, hi) for lo, hi in parts[1:]]
        error = None
        try:
            fn(*parts[0])
        except BaseException as exc:  # noqa: BLE001 - raised after the others finish (they share buffers)
            error = exc
        for job in pending:
            job.wait()
            if error is None and job.error is not None:
                error = job.error
    if error is not None:
        raise error


class _OpenBlasThreads:
    """One BLAS thread while ops are split over threads, then the rank's share again.

    OpenBLAS built with its own threads (NumPy's wheels) serialises concurrent multi-threaded
    calls on one lock: attention's per-head GEMMs from two threads took as long as from one
    (7.0 vs 8.0 ms forward at the example GPT's shape, 2 cores). With one BLAS thread each
    caller runs at once (8.7 -> 3.3 ms). Counted, so overlapping split ops (the communication
    thread's and the main thread's) restore it once, after the last. Where NumPy's BLAS is not
    an OpenBLAS that says so (MKL, a system BLAS), nothing is changed."""

    def __init__(self):
        self._count, self._saved, self._lib = 0, None, False
        self._count_lock = threading.Lock()

    def _functions(self):
        if self._lib is False:
            self._lib = _find_openblas()
        return self._lib

    @contextlib.contextmanager
    def single(self):
        fns = self._functions()
        if fns is None:
            yield
            return
        get, set_ = fns
        with self._count_lock:
            if self._count == 0:
                self._saved = get()
                if self._saved > 1:
                    set_(1)
            self._count += 1
        try:
            yield
        finally:
            with self._count_lock:
                self._count -= 1
                if self._count == 0 and self._saved and self._saved > 1:
                    set_(self._saved)


def _find_openblas():
    """(get, set) of the OpenBLAS NumPy links (its wheels' scipy-openblas, or a plain one), or None."""
    import ctypes
    import glob

    candidates = sorted(glob.glob(os.path.join(os.path.dirname(np.__file__) + ".libs", "*openblas*")))
    for path in candidates + [None]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                                   ("openblas_get_num_threads", "openblas_set_num_threads")):
            get, set_ = getattr(lib, get_name, None), getattr(lib, set_name, None)
            if get is not None and set_ is not None:
                get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
                return get, set_
    return None


_blas = _OpenBlasThreads()


def blas_threads() -> int | None:
    """OpenBLAS's thread count as it reports it (None where NumPy's BLAS is not such an OpenBLAS)."""
    fns = _blas._functions()
    return None if fns is None else int(fns[0]())


def _get_pool(workers: int):
    """The pool, with at least ``workers`` workers (it grows; it never stops)."""
    global _pool
    with _lock:
        if _pool is None:
            _watch_forks()
            _pool = _Pool()
        _pool.grow(workers)
        return _pool


_fork_hook = False


def _watch_forks() -> None:
    """Once: a forked child forgets the pool (it has none of the parent's threads) and makes its own."""
    global _fork_hook
    if not _fork_hook:
        os.register_at_fork(after_in_child=_forget_pool)
        _fork_hook = True


def _forget_pool():
    """In a forked child: a fresh pool, lock and BLAS count (the parent's threads are not there;
    a lock or count held by one of them at the fork would never be released)."""
    global _pool, _lock, _blas
    _pool, _lock, _blas = None, threading.Lock(), _OpenBlasThreads()


class _Job:
    __slots__ = ("fn", "args", "done", "error")

    def __init__(self, fn, args):
        self.fn, self.args, self.done, self.error = fn, args, threading.Event(), None

    def wait(self):
        self.done.wait()


class _Pool:
    """Daemon worker threads taking jobs from one queue (a job's error is kept for its caller)."""

    def __init__(self):
        import queue

        self.size, self._jobs = 0, queue.SimpleQueue()

    def grow(self, size: int) -> None:
        """At least ``size`` workers (called under the module lock)."""
        while self.size < size:
            threading.Thread(target=self._work, name=f"hpctrain-cpu-{self.size}", daemon=True).start()
            self.size += 1

    def submit(self, fn, *args) -> _Job:
        job = _Job(fn, args)
        self._jobs.put(job)
        return job

    def _work(self):
        while True:
            job = self._jobs.get()
            try:
                job.fn(*job.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.error = exc
            finally:
                job.done.set()


def add_partials(partials: np.ndarray) -> np.ndarray:
    """The float64 sum of ``partials`` (chunks, ...) over its first axis (NumPy adds the rows of a
    C-contiguous array one after another: chunk order, the same whoever wrote them)."""
    return np.add.reduce(partials, axis=0, dtype=np.float64)

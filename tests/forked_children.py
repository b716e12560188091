"""run_isolated's children forked from a fork server that has made their imports: a test tool.

Production reads every checkpoint in a fresh ``python -c`` child (hpctrain/ckpt/isolated.py), whose
cost is its start-up (python, numpy and h5py: 0.3-0.4 s of CPU), not its decoding; a test that loads
hundreds of checkpoints spends most of its time there. :func:`install` puts :func:`forked_run` in
``isolated.spawn_child``: each child is forked from a fork server that has imported
``hpctrain.ckpt.isolated`` and h5py, and runs the exec'd child's own code (``sys.exit(main(op,
path, *args))``, the same argv) with its stdout, stderr and passed file descriptors where the exec'd
child has them; run_isolated around it (timeout, a crash read from the exit status, the answer from
stdout) is unchanged. tests/test_fuzz_checkpoint.py checks that the two kinds of child answer alike
on a pristine file, a CRC failure and a file that crashes HDF5; the serial phase reads through
exec'd children everywhere (tests/test_ckpt_isolation.py: crashes, loops, the heap cap).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import subprocess
import threading
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait

_fork = multiprocessing.get_context("forkserver")

# in the forked child: its stdout, stderr and passed fds where the exec'd child has them, then its code
FORK_CHILD = '''
import fcntl, os, sys
moved = [(fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD, 1000), at) for conn, at in fds]  # clear of every target
for fd, at in moved:
    os.dup2(fd, at)
    os.close(fd)
sys.argv = argv
exec(code, {"__name__": "__main__"})
'''
_start_and_reap = threading.Lock()  # multiprocessing reads exit statuses from pipes: one reader at a time


def start() -> None:
    """Start the fork server with the exec'd child's imports made (before the caller's threads exist)."""
    _fork.set_forkserver_preload(["hpctrain.ckpt.isolated", "h5py"])
    forkserver.ensure_running()


def install():
    """Start the server and make run_isolated use :func:`forked_run`; returns what to restore."""
    from hpctrain.ckpt import isolated

    start()
    before, isolated.spawn_child = isolated.spawn_child, forked_run
    return before


def forked_run(argv, *, env, timeout, pass_fds=()) -> subprocess.CompletedProcess:
    """isolated.exec_child's contract for ``argv = [python, "-c", code, op, path, *args]``; ``env`` only
    points the exec'd child at the package, which the fork server has imported."""
    assert argv[1] == "-c", argv
    out, err = os.memfd_create("stdout"), os.memfd_create("stderr")
    try:
        fds = [(Connection(os.dup(fd)), at) for fd, at in [(out, 1), (err, 2), *((fd, fd) for fd in pass_fds)]]
        child = _fork.Process(target=exec, args=(FORK_CHILD, {"fds": fds, "argv": argv[1:2] + argv[3:],
                                                              "code": argv[2]}))
        with _start_and_reap:
            child.start()
        for conn, _ in fds:
            conn.close()
        timed_out = not wait([child.sentinel], timeout)
        with _start_and_reap:
            if timed_out:
                child.kill()
            child.join()
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(argv, child.exitcode, _decoded(out), _decoded(err))
    finally:
        os.close(out)
        os.close(err)


def _decoded(fd) -> str:
    """What text=True makes of the bytes: the locale's encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(os.pread(fd, os.fstat(fd).st_size, 0))).read()

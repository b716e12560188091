"""Decode checkpoint files only in a child process, so a corrupt file cannot crash, hang or
exhaust the process that reads it.

HDF5 trusts the metadata it reads: one damaged byte of an object header can make it crash, loop for
ever, allocate what a damaged size says, or read memory it never initialised, before any checksum of
ours is looked at. So every production read runs here: :func:`run_isolated` starts a fresh
``python -c`` child that runs one op of :data:`.decode.CHILD_OPS` and answers one JSON line
(``verify_file``, ``header_of``, ``inspect_file`` for :mod:`.read` and the ``ckpt`` commands;
``read_share`` for :mod:`.share`, which gets the arrays through a memory file instead). Local: each
rank of a load runs its own child.

The child caps its heap (RLIMIT_DATA) at :data:`HEAP_BASE_BYTES` plus the file's size, more than a
healthy file needs, so a damaged size is a ``MemoryError``. That, a crash (a negative exit), a timeout
(:func:`timeout_for`, scaled with the bytes read) or a malformed answer is
:class:`~.checks.CorruptCheckpoint`, as is an error the reader raised, except
:class:`~.checks.UnreadableCheckpoint` (the OS refused the file). Cost per read: docs/checkpoint-format.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from .decode import CHILD_OPS

TIMEOUT_S = 60  # plus the size term below: a healthy file's metadata decodes in well under a second
SLOW_READ_BYTES_PER_S = 20e6  # the slowest file system we wait for before calling a read stuck
HEAP_BASE_BYTES = 1 << 30  # the child's heap cap beyond the file's size (python + h5py take ~100 MB)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timeout_for(path: str, share: float = 1.0) -> float:
    """How long a child may take on ``path`` reading ``share`` of its bytes."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return TIMEOUT_S + share * size / SLOW_READ_BYTES_PER_S


def exec_child(argv: list[str], *, env: dict, timeout: float, pass_fds=()) -> subprocess.CompletedProcess:
    """Run the child ``argv`` (``python -c CODE ARGS``): its exit status and text output, or
    ``subprocess.TimeoutExpired`` after killing it. What :data:`spawn_child` is in production."""
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          pass_fds=pass_fds)


# How run_isolated starts its children: a fresh python each time. A test tool may put a function with
# exec_child's contract here (tests/forked_children.py: children forked from a server that has made
# the imports, where 0.3-0.4 s of start-up per read is most of a test's time).
spawn_child = exec_child


def run_isolated(op: str, path: str, *args, timeout: float | None = None, pass_fds=()):
    """``op(path, *args)`` (an op of :data:`~.decode.CHILD_OPS`; ``args`` are ints) in a child process: its result
    (JSON-decoded: tuples come back as lists), or the UserError it raised; a crash, a timeout or
    exhausted memory raises CorruptCheckpoint."""
    from .checks import CorruptCheckpoint, UnreadableCheckpoint

    timeout = timeout_for(path) if timeout is None else timeout
    # the child imports this very package, wherever it came from (installed, or a source tree)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    code = "import sys; from hpctrain.ckpt.isolated import main; sys.exit(main(*sys.argv[1:]))"
    try:
        proc = spawn_child([sys.executable, "-c", code, op, path, *map(str, args)], env=env, timeout=timeout,
                           pass_fds=pass_fds)
    except subprocess.TimeoutExpired:
        raise CorruptCheckpoint(f"{path}: reading it did not finish in {timeout:.0f} s: the file is corrupt "
                                f"(a cycle in its HDF5 metadata), or its file system hangs") from None
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else "a signal"
        raise CorruptCheckpoint(f"{path}: HDF5 crashed ({name}) decoding it: the file is corrupt")
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        kind = "result" if "result" in answer else answer["error"]
    except (IndexError, ValueError, TypeError, KeyError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CorruptCheckpoint(f"{path}: reading it failed (exit {proc.returncode}: {tail})") from None
    if kind != "result":
        raise (UnreadableCheckpoint if kind == "unreadable" else CorruptCheckpoint)(str(answer.get("text")))
    return answer["result"]


def _cap_heap(path: str) -> None:
    import resource

    try:
        cap = HEAP_BASE_BYTES + os.path.getsize(path)
    except OSError:
        return  # the reader reports the unreadable file
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft == resource.RLIM_INFINITY or soft > cap:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))


def main(op: str, path: str, *args: str) -> int:
    """The child: run the op (its function decodes in this process, which is the isolation), answer
    one JSON line on stdout."""
    from ..errors import UserError
    from .checks import UnreadableCheckpoint

    _cap_heap(path)
    fn = CHILD_OPS[op]
    try:
        answer = {"result": fn(path, *map(int, args))}
    except UnreadableCheckpoint as exc:
        answer = {"error": "unreadable", "text": str(exc)}
    except UserError as exc:
        answer = {"error": "corrupt", "text": " ".join(str(exc).split("\n"))}
    except MemoryError:
        answer = {"error": "corrupt", "text": f"{path}: reading it would take more memory than the file's size "
                                              f"allows: the file is corrupt"}
    print(json.dumps(answer, default=_plain))
    return 0


def _plain(value):
    """JSON for what readers return beyond JSON's types: numpy scalars and arrays."""
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)

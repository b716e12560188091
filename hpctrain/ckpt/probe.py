"""Read a checkpoint in a child process first, so a corrupt file cannot crash or hang us.

HDF5 trusts the metadata it reads: one flipped bit in an object header can
crash the library (SIGSEGV: seen with a bit of an attribute's datatype) or
send it round a cycle for ever, before any checksum of ours is looked at. So:

  * :func:`probe` (what the readers in :mod:`.read` run before they open a
    file in this process) has a child decode all the metadata they touch
    (:func:`walk_metadata`); a crash, a timeout or an error there is a
    :class:`~.checks.CorruptCheckpoint`. Then this process decodes the same
    bytes. Residual risk: a few damaged datatypes make HDF5 read memory it
    never initialised, so it crashes on some runs only (4 of the ~52,000
    single-byte corruptions of a small checkpoint tried here passed a probe
    and then crashed a later read).
  * :func:`run_isolated` runs a whole serial reader (``verify_file``,
    ``header_of``, ``inspect_file``) in the child and returns its result, so
    the ``ckpt`` command never decodes a file itself and cannot crash at all.

Cost: one Python start with h5py (~0.2 s here) per file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

PROBE_TIMEOUT_S = 60  # generous: a healthy file's metadata decodes in well under a second
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OPS = ("walk_metadata", "verify_file", "header_of", "inspect_file")


def run_isolated(op: str, path: str, timeout: float = PROBE_TIMEOUT_S):
    """``op(path)`` (one of ``_OPS``) in a child process: its result (JSON-decoded: tuples come back
    as lists), or the UserError it raised; a crash or a timeout raises CorruptCheckpoint."""
    from .checks import CorruptCheckpoint, UnreadableCheckpoint

    # the child imports this very package, wherever it came from (installed, or a source tree)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p))
    code = "import sys; from hpctrain.ckpt.probe import main; sys.exit(main(sys.argv[1], sys.argv[2]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, op, path], env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CorruptCheckpoint(f"{path}: decoding its HDF5 metadata did not finish in {timeout:.0f} s: the file "
                                f"is corrupt (a cycle in it), or its file system hangs") from None
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else "a signal"
        raise CorruptCheckpoint(f"{path}: HDF5 crashed ({name}) decoding its metadata: the file is corrupt")
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CorruptCheckpoint(f"{path}: reading it failed (exit {proc.returncode}: {tail})") from None
    if "error" in answer:
        raise (UnreadableCheckpoint if answer["error"] == "unreadable" else CorruptCheckpoint)(answer["text"])
    return answer["result"]


def probe(path: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Return if a child process decodes ``path``'s metadata; raise CorruptCheckpoint (or
    UnreadableCheckpoint for an OS-level read failure) naming what happened otherwise."""
    run_isolated("walk_metadata", path, timeout)


def walk_metadata(path: str) -> None:
    """Decode every piece of metadata the readers touch: root and dataset attributes, types,
    shapes, layouts, and one row of each dataset (no checksums). Run in the child."""
    from .checks import attr_value, check_dataset, datasets
    from .read import _reading

    with _reading(path, isolate=False) as f:
        for value in f.attrs.values():
            attr_value(value)
        for name, d in datasets(f, path):
            for value in d.attrs.values():
                attr_value(value)
            check_dataset(d, path, name)
            d.id.get_offset()
            d[:1]


def main(op: str, path: str) -> int:
    """The child: run the op with no probe of its own, answer one JSON line on stdout."""
    from ..errors import UserError
    from . import read
    from .checks import UnreadableCheckpoint

    read.ISOLATE = False  # this process is the isolation
    fn = walk_metadata if op == "walk_metadata" else getattr(read, op) if op in _OPS else None
    try:
        answer = {"result": fn(path)}
    except UnreadableCheckpoint as exc:
        answer = {"error": "unreadable", "text": str(exc)}
    except UserError as exc:
        answer = {"error": "corrupt", "text": " ".join(str(exc).split("\n"))}
    print(json.dumps(answer, default=str))
    return 0

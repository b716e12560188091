"""HDF5 decoding a checkpoint file in this process: the work of the isolated child (:mod:`.isolated`).

HDF5 may crash, loop or exhaust memory on a damaged file, so the training process never calls
these: :mod:`.read` and :mod:`.share` have a child run them (:func:`~.isolated.run_isolated` looks
the op up in :data:`CHILD_OPS`). Each checks the file's header and layout (:mod:`.checks`); a
failure that is not already a UserError becomes :class:`~.checks.CorruptCheckpoint`. Serial, no MPI.

  op             function       does
  verify_file    verify_file    every dataset read and compared with its CRC-32; the header
  header_of      header_of      the checked header (no data read)
  inspect_file   inspect_file   root attributes and one row per dataset (no data read)
  read_share     write_share    one rank's share of every dataset (or the boxes it asks for) into a memory
                                file the parent passed
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os

import numpy as np

from ..errors import UserError
from .checks import (CorruptCheckpoint, UnreadableCheckpoint, attr_value, check_step, checked, datasets, header,
                     stored_crc)
from .format import combine_parts, crc32_of, row_range

VERIFY_BLOCK_BYTES = 64 << 20  # serial verification reads this much at a time
ALIGN = 64  # each array starts on a cache line of the memory file


def _readable(path: str) -> None:
    """UnreadableCheckpoint if the OS refuses the file."""
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{path}: cannot be read ({exc.strerror or exc}); check that it exists on "
                                   f"every node and is readable") from None


def _open(path: str):
    import h5py

    _readable(path)
    try:
        # no HDF5 file locks: readers never conflict, and Lustre/NFS often refuse flock
        return h5py.File(path, "r", locking=False)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"{path}: cannot be opened as HDF5 ({exc}); truncated or overwritten?") from None


@contextlib.contextmanager
def _reading(path: str):
    """The open file; any failure inside that is not already a UserError becomes CorruptCheckpoint."""
    f = _open(path)
    try:
        yield f
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any read failure means an unusable file
        raise CorruptCheckpoint(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    finally:
        f.close()


def verify_file(path: str) -> dict:
    """Read every dataset of ``path`` and compare its CRC-32; returns the header. Serial, no MPI.

    Raises :class:`CorruptCheckpoint` naming the first problem.
    """
    with _reading(path) as f:
        attrs, dsets = checked(f, path)
        for name, d in dsets:
            row_bytes = max(1, d.dtype.itemsize * int(np.prod(d.shape[1:])))
            step = max(1, VERIFY_BLOCK_BYTES // row_bytes)
            parts = [(crc32_of(b), b.nbytes) for b in (d[lo:lo + step] for lo in range(0, d.shape[0], step))]
            got, want = combine_parts(parts), stored_crc(d, path, name)
            if got != want:
                raise CorruptCheckpoint(f"{path}: dataset {name} fails its checksum (stored crc32 "
                                        f"{want:#010x}, computed {got:#010x}): the file is corrupt")
        position = dict(dsets).get("/data/position")
        check_step(path, attrs, None if position is None else position[:1])  # its bytes were just verified
        return attrs


def header_of(path: str) -> dict:
    """The checked header of ``path`` (no data read); CorruptCheckpoint / UnreadableCheckpoint otherwise."""
    with _reading(path) as f:
        return header(f, path)


def inspect_file(path: str) -> tuple[dict, list]:
    """Root attributes and (path, shape, dtype, bytes, crc32, per_rank) per dataset, without reading data."""
    with _reading(path) as f:
        attrs = {k: attr_value(v) for k, v in f.attrs.items()}
        rows = [(name, tuple(d.shape), str(d.dtype), int(d.size) * d.dtype.itemsize,
                 int(d.attrs["crc32"]) if "crc32" in d.attrs else None, bool(d.attrs.get("per_rank", False)))
                for name, d in datasets(f, path)]
        return attrs, rows


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _request(fd: int) -> list:
    """The boxes asked for: [(name, start, count, shape)] from the JSON in memory file ``fd`` (-1: none)."""
    if fd < 0:
        return []
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(fd), "rb") as fh:
        items = json.loads(fh.read().decode("utf-8") or "[]")
    return [(str(name), tuple(int(x) for x in start), tuple(int(x) for x in count), tuple(int(x) for x in whole))
            for name, start, count, whole in items]


def _fits(start, count, whole, shape) -> bool:
    return tuple(whole) == tuple(shape) and len(start) == len(count) == len(shape) and all(
        0 <= a and 0 <= c and a + c <= n for a, c, n in zip(start, count, shape))


def write_share(path: str, rank: int, size: int, fd: int, request_fd: int = -1) -> dict:
    """Check ``path`` and read rank ``rank`` of ``size``'s share of it into the memory file ``fd``
    (resized to fit), for :func:`~.share.read_share`. Returns the root attributes and, per dataset
    in :func:`~.checks.datasets` order, its name, shape, dtype, stored CRC, per_rank flag, the rows
    [lo, hi) read and their offset in ``fd``, and the offset of the rank's own row (per-rank
    datasets the rank has a row of) or None. ``request_fd`` >= 0: a memory file holding the boxes
    asked for (JSON [[name, start, count, shape], ...]); their datasets are read only there (no
    rows), and ``boxes`` gives each box's offset in ``fd``, or None where the file has no such
    dataset or one of another shape."""
    request = _request(request_fd)
    asked: dict = {}
    for k, (name, start, count, whole) in enumerate(request):
        asked.setdefault(name, []).append((k, start, count, whole))
    with _reading(path) as f:
        attrs, dsets = checked(f, path)
        plan, total, boxes = [], 0, [None] * len(request)
        for name, d in dsets:
            per_rank = bool(d.attrs.get("per_rank", False))
            lo, hi = (0, 0) if name in asked else row_range(d.shape[0], rank, size)
            row_bytes = d.dtype.itemsize * int(np.prod(d.shape[1:]))
            entry = {"name": name, "shape": list(d.shape), "dtype": d.dtype.str, "crc": stored_crc(d, path, name),
                     "per_rank": per_rank, "rows": [lo, hi], "at": total, "own_at": None}
            total = _aligned(total + (hi - lo) * row_bytes)
            if per_rank and rank < d.shape[0]:
                entry["own_at"], total = total, _aligned(total + row_bytes)
            plan.append((entry, d))
            for k, start, count, whole in asked.get(name, []):
                if _fits(start, count, whole, d.shape):
                    boxes[k], total = total, _aligned(total + int(np.prod(count)) * d.dtype.itemsize)
        # storage equals logical size (check_dataset), own rows repeat at most one row each, and a
        # rank's boxes are disjoint parts of the datasets
        if total > 2 * os.path.getsize(path) + ALIGN * (len(plan) + len(request)):
            raise CorruptCheckpoint(f"{path}: its datasets declare more bytes than the file holds: the file is corrupt")
        os.ftruncate(fd, total)
        if total:
            with mmap.mmap(fd, total) as memory:
                for entry, d in plan:
                    _read_rows(d, memory, entry["at"], entry["rows"])
                    if entry["own_at"] is not None:
                        _read_rows(d, memory, entry["own_at"], [rank, rank + 1])
                    for k, start, count, _ in asked.get(entry["name"], []):
                        if boxes[k] is not None:
                            _read_box(d, memory, boxes[k], start, count)
        return {"attrs": attrs, "arrays": [entry for entry, _ in plan], "bytes": total, "boxes": boxes}


def _read_box(d, memory, at: int, start, count) -> None:
    n = int(np.prod(count))
    if n:
        view = np.frombuffer(memory, d.dtype, n, at).reshape(count)
        d.read_direct(view, tuple(slice(a, a + c) for a, c in zip(start, count)))
        del view


def _read_rows(d, memory, at: int, rows) -> None:
    lo, hi = rows
    if hi > lo:
        view = np.frombuffer(memory, d.dtype, (hi - lo) * int(np.prod(d.shape[1:])), at)
        d.read_direct(view.reshape((hi - lo,) + d.shape[1:]), np.s_[lo:hi])
        del view  # the map closes only when no array points into it


# what a child may be asked to run: op name -> function(path, *int args)
CHILD_OPS = {"verify_file": verify_file, "header_of": header_of, "inspect_file": inspect_file,
             "read_share": write_share}

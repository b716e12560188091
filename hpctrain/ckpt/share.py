"""One rank's share of a checkpoint, read in a child process and handed back through memory.

Each rank of a load reads 1/size of every dataset's rows (to checksum them; the replicated
arrays are then all-gathered) and its own row of the per-rank ones. HDF5 decoding a
corrupt file may crash or loop (:mod:`.isolated`), so :func:`read_share` has a child run
:func:`write_share`: it checks the file's header and layout, and reads the rows with
``read_direct`` straight into a memory file (``memfd``) the parent created; the parent maps
that file and uses the arrays in place, without a copy. So the training process never
decodes the checkpoint's HDF5 metadata, and what it gets is checked by its own CRCs.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np

from .checks import CorruptCheckpoint, checked, stored_crc
from .format import row_range

ALIGN = 64  # each array starts on a cache line of the memory file


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write_share(path: str, rank: int, size: int, fd: int) -> dict:
    """The child's part: check ``path`` and read rank ``rank`` of ``size``'s share of it into the
    memory file ``fd`` (resized to fit). Returns the root attributes and, per dataset in
    :func:`~.checks.datasets` order, its name, shape, dtype, stored CRC, per_rank flag, the rows
    [lo, hi) read and their offset in ``fd``, and the offset of the rank's own row (per-rank
    datasets the rank has a row of) or None."""
    from .read import _reading

    with _reading(path) as f:
        attrs, dsets = checked(f, path)
        plan, total = [], 0
        for name, d in dsets:
            per_rank = bool(d.attrs.get("per_rank", False))
            lo, hi = row_range(d.shape[0], rank, size)
            row_bytes = d.dtype.itemsize * int(np.prod(d.shape[1:]))
            entry = {"name": name, "shape": list(d.shape), "dtype": d.dtype.str, "crc": stored_crc(d, path, name),
                     "per_rank": per_rank, "rows": [lo, hi], "at": total, "own_at": None}
            total = _aligned(total + (hi - lo) * row_bytes)
            if per_rank and rank < d.shape[0]:
                entry["own_at"], total = total, _aligned(total + row_bytes)
            plan.append((entry, d))
        # storage equals logical size (check_dataset) and own rows repeat at most one row each
        if total > 2 * os.path.getsize(path) + ALIGN * len(plan):
            raise CorruptCheckpoint(f"{path}: its datasets declare more bytes than the file holds: the file is corrupt")
        os.ftruncate(fd, total)
        if total:
            with mmap.mmap(fd, total) as memory:
                for entry, d in plan:
                    _read_rows(d, memory, entry["at"], entry["rows"])
                    if entry["own_at"] is not None:
                        _read_rows(d, memory, entry["own_at"], [rank, rank + 1])
        return {"attrs": attrs, "arrays": [entry for entry, _ in plan], "bytes": total}


def _read_rows(d, memory, at: int, rows) -> None:
    lo, hi = rows
    if hi > lo:
        view = np.frombuffer(memory, d.dtype, (hi - lo) * int(np.prod(d.shape[1:])), at)
        d.read_direct(view.reshape((hi - lo,) + d.shape[1:]), np.s_[lo:hi])
        del view  # the map closes only when no array points into it


def read_share(path: str, rank: int, size: int, isolate: bool = True):
    """Rank ``rank`` of ``size``'s share of ``path``: (root attributes, [(name, shape, dtype str,
    stored crc, per_rank)] sorted by name, {name: rows [lo, hi) of every dataset}, {name: own
    row of each per-rank dataset the rank has one of}). The arrays are read-only views of shared
    memory, freed with the last of them. CorruptCheckpoint / UnreadableCheckpoint otherwise."""
    from .isolated import run_isolated, timeout_for

    fd = os.memfd_create("hpctrain-ckpt-share") if hasattr(os, "memfd_create") else _unlinked_temp_file()
    try:
        if isolate:
            answer = run_isolated("read_share", path, rank, size, fd, timeout=timeout_for(path, 1 / size),
                                  pass_fds=(fd,))
        else:
            answer = write_share(path, rank, size, fd)
        try:
            return _arrays(answer, fd)
        except (KeyError, TypeError, ValueError, IndexError):  # never from our child; checked all the same
            raise CorruptCheckpoint(f"{path}: the reading process gave a malformed answer") from None
    finally:
        os.close(fd)


def _unlinked_temp_file() -> int:
    fd, name = tempfile.mkstemp(prefix="hpctrain-ckpt-share-")
    os.unlink(name)
    return fd


def _arrays(answer: dict, fd: int):
    total = int(answer["bytes"])
    if not 0 <= total <= os.fstat(fd).st_size:
        raise ValueError("size")
    memory = mmap.mmap(fd, total, access=mmap.ACCESS_READ) if total else b""
    meta, blocks, own = [], {}, {}
    for e in answer["arrays"]:
        name, shape, dtype, lo, hi = str(e["name"]), tuple(int(n) for n in e["shape"]), np.dtype(e["dtype"]), *e["rows"]
        if dtype.kind not in "fiub" or dtype.byteorder == ">" or not shape or min(shape) < 0:
            raise ValueError("dtype")
        meta.append((name, shape, dtype.str, int(e["crc"]), bool(e["per_rank"])))
        blocks[name] = _view(memory, dtype, (int(hi) - int(lo),) + shape[1:], int(e["at"]), total)
        if e["own_at"] is not None:
            own[name] = _view(memory, dtype, shape[1:], int(e["own_at"]), total)
    return answer["attrs"], meta, blocks, own


def _view(memory, dtype, shape, at: int, total: int):
    count = int(np.prod(shape))
    if at < 0 or at + count * dtype.itemsize > total:
        raise ValueError("offset")
    if count == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(memory, dtype, count, at).reshape(shape)

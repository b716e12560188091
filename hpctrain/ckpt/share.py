"""One rank's share of a checkpoint, read in a child process and handed back through memory.

:func:`read_share` (called by :func:`~.read.load_checkpoint` on every rank; local) gets 1/size of
every dataset's rows (to checksum them; the replicated arrays are then all-gathered) and the rank's
own row of the per-rank ones; :func:`read_boxes` also the boxes a rank's layout needs, read instead
of the rows of their datasets. HDF5 may crash or loop on a corrupt file (:mod:`.isolated`), so a
child runs :func:`~.decode.write_share`: it checks the file's header and layout and reads the rows
with ``read_direct`` straight into a memory file (``memfd``) this process created; this process maps
the file and uses the arrays in place, without a copy, after checking the child's answer (dtypes,
offsets within the file). So the training process never decodes HDF5 metadata, and the caller checks
what it gets against the stored CRCs.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile

import numpy as np

from .checks import CorruptCheckpoint
from .decode import write_share
from .isolated import run_isolated, timeout_for


def read_share(path: str, rank: int, size: int, isolate: bool = True):
    """Rank ``rank`` of ``size``'s share of ``path``: (root attributes, [(name, shape, dtype str,
    stored crc, per_rank)] sorted by name, {name: rows [lo, hi) of every dataset}, {name: own
    row of each per-rank dataset the rank has one of}). The arrays are read-only views of shared
    memory, freed with the last of them. CorruptCheckpoint / UnreadableCheckpoint otherwise.
    ``isolate=False`` runs the child's part in this process (the tests compare the two)."""
    return read_boxes(path, rank, size, None, isolate=isolate)[:4]


def read_boxes(path: str, rank: int, size: int, request, share: float | None = None, isolate: bool = True):
    """:func:`read_share`, plus the boxes ``request`` asks for ([(name, start, count, shape)]), read
    instead of the rows of their datasets: a fifth item, the array of each box (or None where the
    file has no such dataset, or one of another shape). ``share``: the fraction of the file's bytes the
    boxes are, for the child's timeout."""
    fd = _memory_file("hpctrain-ckpt-share")
    asked = -1
    try:
        if request:
            asked = _memory_file("hpctrain-ckpt-request")
            text = json.dumps([[n, list(map(int, a)), list(map(int, c)), list(map(int, w))]
                               for n, a, c, w in request]).encode()
            while text:
                text = text[os.write(asked, text):]
        if isolate:
            fraction = 1 / size if share is None else min(1.0, share + 1 / size)
            answer = run_isolated("read_share", path, rank, size, fd, asked, timeout=timeout_for(path, fraction),
                                  pass_fds=(fd,) if asked < 0 else (fd, asked))
        else:
            answer = write_share(path, rank, size, fd, asked)
        try:
            return _arrays(answer, fd, request or [])
        except (KeyError, TypeError, ValueError, IndexError):  # never from our child; checked all the same
            raise CorruptCheckpoint(f"{path}: the reading process gave a malformed answer") from None
    finally:
        os.close(fd)
        if asked >= 0:
            os.close(asked)


def _memory_file(name: str) -> int:
    return os.memfd_create(name) if hasattr(os, "memfd_create") else _unlinked_temp_file()


def _unlinked_temp_file() -> int:
    fd, name = tempfile.mkstemp(prefix="hpctrain-ckpt-share-")
    os.unlink(name)
    return fd


def _arrays(answer: dict, fd: int, request: list):
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
    dtypes = {name: np.dtype(dtype) for name, _, dtype, _, _ in meta}
    shapes = {name: shape for name, shape, *_ in meta}
    at = answer["boxes"] if request else []
    if len(at) != len(request):
        raise ValueError("boxes")
    boxes = []
    for (name, start, count, whole), a in zip(request, at):
        if a is None or name not in dtypes:
            boxes.append(None)
            continue
        if tuple(whole) != shapes[name] or any(s < 0 or c < 0 or s + c > n for s, c, n in zip(start, count, whole)):
            raise ValueError("box")   # the child reads only boxes that fit
        boxes.append(_view(memory, dtypes[name], tuple(count), int(a), total))
    return answer["attrs"], meta, blocks, own, boxes


def _view(memory, dtype, shape, at: int, total: int):
    count = int(np.prod(shape))
    if at < 0 or at + count * dtype.itemsize > total:
        raise ValueError("offset")
    if count == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(memory, dtype, count, at).reshape(shape)

"""One rank's share of a checkpoint, read in a child process and handed back through memory.

:func:`read_share` (called by :func:`~.read.load_checkpoint` on every rank; local) gets 1/size of
every dataset's rows (to checksum them; the replicated arrays are then all-gathered) and the rank's
own row of the per-rank ones. HDF5 may crash or loop on a corrupt file (:mod:`.isolated`), so a
child runs :func:`~.decode.write_share`: it checks the file's header and layout and reads the rows
with ``read_direct`` straight into a memory file (``memfd``) this process created; this process maps
the file and uses the arrays in place, without a copy, after checking the child's answer (dtypes,
offsets within the file). So the training process never decodes HDF5 metadata, and the caller checks
what it gets against the stored CRCs.
"""

from __future__ import annotations

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

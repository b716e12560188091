"""Reading checkpoints: verification (every byte against its CRC) and the parallel load.

:func:`load_checkpoint` (resume, rollback, ``sample``; collective over the world) has each rank
read the boxes its layout needs (:mod:`.ownership`; resume and rollback) and 1/size of the rows of
every other dataset (:mod:`.share`), checksum a tiling of every dataset between them, XOR the CRC
contributions into one verdict for every rank (:mod:`.crc`) and check whole what it read whole,
then all-gather the replicated arrays it did not read as boxes, the small ones only when it read
boxes (``sample``: all of them). :func:`verify_file`, :func:`header_of` and :func:`inspect_file` are
serial (the ops the ``ckpt`` commands run). HDF5 decodes a file only in
a child process (:mod:`.isolated` runs :mod:`.decode`), since it can crash, loop or exhaust memory on
a damaged one; the CRCs cover the arrays and the root attributes, and the layout is checked too
(:mod:`.checks`). Serial h5py only, so resuming works with or without parallel HDF5. Nothing in a
file is executed or unpickled: only numeric datasets and plain attributes are read (the stored
config is parsed as TOML data).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

import numpy as np

from .checks import CorruptCheckpoint, UnreadableCheckpoint, check_step
from .crc import box_contribution, finish
from .format import row_range
from .isolated import run_isolated
from .share import read_boxes

__all__ = ["CorruptCheckpoint", "UnreadableCheckpoint", "LoadedCheckpoint", "verify_file", "load_checkpoint",
           "header_of", "inspect_file"]


@dataclass
class LoadedCheckpoint:
    path: str
    attrs: dict
    full: dict = field(default_factory=dict)       # replicated arrays, whole, by dataset path
    own_rows: dict = field(default_factory=dict)   # per-rank arrays: this rank's row (absent beyond the saved world)
    # read at another world size than the saved one, the per-rank arrays over every saved rank:
    # a float array's mean row (float64), an integer array whole (saved world, ...)
    across_ranks: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)     # every dataset's shape, by path
    dtypes: dict = field(default_factory=dict)     # and its dtype
    boxes: list = field(default_factory=list)      # the array of each box asked for (``wanted``), in order
    unfit: frozenset = frozenset()                 # datasets asked for that the file lacks, or boxes it cannot hold

    @property
    def step(self) -> int:
        return int(self.attrs["step"])

    @property
    def world_size(self) -> int:
        return int(self.attrs["world_size"])


# without ``wanted``'s boxes, the replicated arrays a load gathers whole; with them, only the small ones
# (the step count, the data position, the loss scale): the rest are checksummed but not gathered
WHOLE_BYTES = 1 << 20


def verify_file(path: str) -> dict:
    """Read every dataset of ``path`` and compare its CRC-32 (in a child process); returns the header.
    Serial, no MPI. Raises :class:`CorruptCheckpoint` naming the first problem."""
    return run_isolated("verify_file", path)


def load_checkpoint(path: str, world, wanted=None) -> LoadedCheckpoint:
    """Read and verify ``path`` on every rank; collective over ``world.comm``.

    Without ``wanted``, each rank reads 1/size of every dataset's rows, and the replicated arrays
    are all-gathered whole (``full``). ``wanted`` [(name, start, count, owned, shape)]: the boxes this rank
    needs of datasets of those shapes (:mod:`.ownership`), read alone from their datasets (``boxes``, in order; nothing
    gathered), the ``owned`` ones tiling each dataset across the ranks; the other datasets as
    without. Either way every byte is checksummed by one rank, and each rank XORs its CRC
    contributions (:mod:`.crc`) into one all-reduce of one integer per dataset: the same verdict
    everywhere. A dataset asked for that the file lacks or whose boxes it cannot hold is in
    ``unfit`` (not checked; the caller's shape check names it). Raises :class:`CorruptCheckpoint`
    on every rank if any part fails.
    """
    from mpi4py import MPI

    comm, rank, size = world.comm, world.rank, world.size
    request = [(name, tuple(start), tuple(count), tuple(whole)) for name, start, count, _, whole in (wanted or [])]
    attrs = meta = blocks = own = failure = None
    boxes, mine, unfit = [], None, set()
    try:  # in a child process (.share): HDF5 never decodes the file in this one
        share = None
        if request:
            nbytes = sum(int(np.prod(c)) for _, _, c, _ in request) * 8  # (a bound: the itemsize is the file's)
            try:
                share = nbytes / max(1, os.path.getsize(path))
            except OSError:
                share = 1.0   # the reader says why it cannot read the file

        attrs, meta, blocks, own, boxes = read_boxes(path, rank, size, request, share)
        asked = {name for name, *_ in request}
        unfit = {name for (name, *_), array in zip(request, boxes) if array is None}
        contribution = {}
        for name, shape, _, _, _ in meta:
            if name not in asked:
                lo = row_range(shape[0], rank, size)[0]
                contribution[name] = box_contribution(blocks[name], (lo,) + (0,) * (len(shape) - 1),
                                                      blocks[name].shape, shape)
        shapes = {name: shape for name, shape, *_ in meta}
        held: dict = {}   # every box this rank read: (XOR of contributions, elements)
        for (name, start, count, owned, _), array in zip(wanted or [], boxes):
            if array is not None:
                c = box_contribution(array, start, count, shapes[name])
                x, n = held.get(name, (0, 0))
                held[name] = (x ^ c, n + array.size)
                if owned:
                    contribution[name] = contribution.get(name, 0) ^ c
        mine = np.array([contribution.get(name, 0) for name, *_ in meta], np.uint32)
        # an array this rank read whole (a data group's replicas, a tensor group's unsplit parameters,
        # the tied table) is checked here too, not only by the rank that owns it: a bad read on one
        # node would otherwise leave that rank's copy unchecked
        for name, shape, dtype, want, _ in meta:
            x, n = held.get(name, (0, 0))
            if n and n == int(np.prod(shape, dtype=np.int64)):
                got = finish(x, n * np.dtype(dtype).itemsize)
                if got != want:
                    raise CorruptCheckpoint(f"{path}: dataset {name} fails its checksum (stored crc32 {want:#010x}, "
                                            f"computed {got:#010x}): the file is corrupt")
    except UnreadableCheckpoint as exc:
        failure = ("unreadable", str(exc))
    except Exception as exc:  # noqa: BLE001 - any other failure: this rank cannot use the file
        text = str(exc) if isinstance(exc, CorruptCheckpoint) else f"{path}: {type(exc).__name__}: {exc}"
        failure = ("corrupt", text)
    digest = None if meta is None else zlib.crc32(repr(meta).encode())
    names = zlib.crc32(repr(sorted({name for name, *_ in request})).encode())
    everyone = comm.allgather((failure, digest, sorted(unfit), names))
    if any(n != names for *_, n in everyone):   # each dataset is read by boxes on every rank, or by rows on every rank
        raise _agreed(RuntimeError(f"{path}: the ranks asked for boxes of different datasets (an empty box where a "
                                   f"rank needs nothing): a bug in the caller, not in the file"))
    everyone = [e[:3] for e in everyone]
    failures = [f for f, _, _ in everyone if f]
    if failures:
        kind, text = failures[0]
        raise _agreed((UnreadableCheckpoint if kind == "unreadable" else CorruptCheckpoint)(text))
    if any(d != everyone[0][1] for _, d, _ in everyone):
        raise _agreed(CorruptCheckpoint(f"{path}: ranks read different contents (is the file being overwritten?)"))
    unfit = frozenset(n for _, _, names in everyone for n in names)
    total = np.zeros_like(mine)
    comm.Allreduce(mine, total, op=MPI.BXOR)
    for i, (name, shape, dtype, want, _) in enumerate(meta):
        if name in unfit:
            continue
        got = finish(int(total[i]), int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        if got != want:
            raise _agreed(CorruptCheckpoint(f"{path}: dataset {name} fails its checksum (stored crc32 "
                                            f"{want:#010x}, computed {got:#010x}): the file is corrupt"))
    # own rows are copied (small), the shared memory of the share goes with the gathered blocks
    out = LoadedCheckpoint(path, attrs, own_rows={name: np.array(row) for name, row in own.items()},
                           shapes={name: tuple(shape) for name, shape, *_ in meta},
                           dtypes={name: np.dtype(dtype) for name, _, dtype, _, _ in meta}, boxes=boxes, unfit=unfit)
    resized = out.world_size != size
    for name, shape, dtype, _, per_rank in meta:
        if name not in blocks or name in {n for n, *_ in request}:
            continue
        if not per_rank:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if not request or nbytes <= WHOLE_BYTES:
                out.full[name] = _allgather_rows(comm, blocks.pop(name), shape, np.dtype(dtype))
        elif resized:
            kind = np.dtype(dtype).kind
            out.across_ranks[name] = (_mean_row(comm, blocks.pop(name), shape) if kind == "f" else
                                      _allgather_rows(comm, blocks.pop(name), shape, np.dtype(dtype)))
    try:
        check_step(path, attrs, out.full.get("/data/position"))
    except CorruptCheckpoint as exc:
        raise _agreed(exc) from None  # the same gathered data on every rank: the same verdict
    return out


def _allgather_rows(comm, mine, shape, dtype):
    """The whole array from every rank's row slice; counted in rows (an MPI contiguous type
    of one row), so arrays of 2^31 elements or more gather too."""
    from mpi4py import MPI

    size = comm.Get_size()
    row = int(np.prod(shape[1:]))
    counts = [hi - lo for lo, hi in (row_range(shape[0], r, size) for r in range(size))]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    full = np.empty(shape, dtype=dtype)
    row_type = MPI._typedict[dtype.char].Create_contiguous(row).Commit()
    try:
        comm.Allgatherv([np.ascontiguousarray(mine), counts[comm.Get_rank()], row_type],
                        [full, (counts, displs), row_type])
    finally:
        row_type.Free()
    return full


MEAN_CHUNK = 1 << 26  # elements per Allreduce of a mean row (MPI counts are 32-bit ints)


def _mean_row(comm, mine, shape):
    """The mean over the leading axis (float64) of an array of which this rank holds rows ``mine``:
    summed in float64 (each rank its rows, then across ranks, in chunks), divided once."""
    from mpi4py import MPI

    partial = mine.sum(axis=0, dtype=np.float64) if len(mine) else np.zeros(shape[1:], np.float64)
    total = np.empty(shape[1:], np.float64)
    src, dst = np.ascontiguousarray(partial).reshape(-1), total.reshape(-1)
    for lo in range(0, max(src.size, 1), MEAN_CHUNK):
        comm.Allreduce(src[lo:lo + MEAN_CHUNK], dst[lo:lo + MEAN_CHUNK], op=MPI.SUM)
    total /= shape[0]
    return total


def _agreed(exc):
    """Mark an error that every rank raises alike (printed once by rank 0, no MPI_Abort)."""
    exc.agreed = True
    return exc


def header_of(path: str) -> dict:
    """The checked header of ``path`` (no data read; in a child process); CorruptCheckpoint /
    UnreadableCheckpoint otherwise."""
    return run_isolated("header_of", path)


def inspect_file(path: str) -> tuple[dict, list]:
    """Root attributes and (path, shape, dtype, bytes, crc32, per_rank) per dataset, without reading data
    (in a child process)."""
    attrs, rows = run_isolated("inspect_file", path)
    return attrs, [tuple(tuple(v) if isinstance(v, list) else v for v in row) for row in rows]

"""Reading checkpoints: verification (every byte against its CRC) and the parallel load.

:func:`load_checkpoint` (resume, rollback, ``sample``; collective over the world) has each rank
read and checksum 1/size of every dataset's rows (:mod:`.share`), combines the CRCs into one verdict
for every rank, then all-gathers the replicated arrays whole. :func:`verify_file`, :func:`header_of`
and :func:`inspect_file` are serial (the ops the ``ckpt`` commands run). HDF5 decodes a file only in
a child process (:mod:`.isolated` runs :mod:`.decode`), since it can crash, loop or exhaust memory on
a damaged one; the CRCs cover the arrays and the root attributes, and the layout is checked too
(:mod:`.checks`). Serial h5py only, so resuming works with or without parallel HDF5. Nothing in a
file is executed or unpickled: only numeric datasets and plain attributes are read (the stored
config is parsed as TOML data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .checks import CorruptCheckpoint, UnreadableCheckpoint, check_step
from .format import combine_parts, crc32_of, row_range
from .isolated import run_isolated
from .share import read_share

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

    @property
    def step(self) -> int:
        return int(self.attrs["step"])

    @property
    def world_size(self) -> int:
        return int(self.attrs["world_size"])


def verify_file(path: str) -> dict:
    """Read every dataset of ``path`` and compare its CRC-32 (in a child process); returns the header.
    Serial, no MPI. Raises :class:`CorruptCheckpoint` naming the first problem."""
    return run_isolated("verify_file", path)


def load_checkpoint(path: str, world) -> LoadedCheckpoint:
    """Read and verify ``path`` on every rank; collective over ``world.comm``.

    Each rank reads and checksums 1/size of every dataset, the CRCs are
    combined and checked (the same verdict everywhere), then the replicated
    arrays are all-gathered whole. Raises :class:`CorruptCheckpoint` on every
    rank if any part fails.
    """
    comm, rank, size = world.comm, world.rank, world.size
    attrs = meta = parts = blocks = own = failure = None
    try:  # in a child process (.share): HDF5 never decodes the file in this one
        attrs, meta, blocks, own = read_share(path, rank, size)
        parts = [(crc32_of(blocks[name]), blocks[name].nbytes) for name, *_ in meta]
    except UnreadableCheckpoint as exc:
        failure = ("unreadable", str(exc))
    except Exception as exc:  # noqa: BLE001 - any other failure: this rank cannot use the file
        text = str(exc) if isinstance(exc, CorruptCheckpoint) else f"{path}: {type(exc).__name__}: {exc}"
        failure = ("corrupt", text)
    everyone = comm.allgather((failure, meta, parts))
    failures = [f for f, _, _ in everyone if f]
    if failures:
        kind, text = failures[0]
        raise _agreed((UnreadableCheckpoint if kind == "unreadable" else CorruptCheckpoint)(text))
    metas = [m for _, m, _ in everyone]
    if any(m != metas[0] for m in metas):
        raise _agreed(CorruptCheckpoint(f"{path}: ranks read different contents (is the file being overwritten?)"))
    for i, (name, shape, dtype, want, _) in enumerate(meta):
        got = combine_parts([p[i] for _, _, p in everyone])
        if got != want:
            raise _agreed(CorruptCheckpoint(f"{path}: dataset {name} fails its checksum (stored crc32 "
                                            f"{want:#010x}, computed {got:#010x}): the file is corrupt"))
    # own rows are copied (small), the shared memory of the share goes with the gathered blocks
    out = LoadedCheckpoint(path, attrs, own_rows={name: np.array(row) for name, row in own.items()})
    resized = out.world_size != size
    for name, shape, dtype, _, per_rank in meta:
        if not per_rank:
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

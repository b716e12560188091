"""Reading checkpoints: verification (every byte against its CRC) and the parallel load.

Reads use plain serial h5py on every rank (read-only opens may share a file),
so resuming works with or without parallel HDF5. Nothing in a file is ever
executed or unpickled: only numeric datasets and plain attributes are read.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from .format import FORMAT_NAME, FORMAT_VERSION, combine_parts, crc32_of, row_range

VERIFY_BLOCK_BYTES = 64 << 20  # serial verification reads this much at a time


class CorruptCheckpoint(UserError):
    """A checkpoint that cannot be used: truncated, incomplete, malformed or failing a checksum."""


class UnreadableCheckpoint(UserError):
    """A file the operating system will not let us read (permissions, missing on this node):
    not evidence of corruption, so ``--resume auto`` stops instead of skipping it."""


@dataclass
class LoadedCheckpoint:
    path: str
    attrs: dict
    full: dict = field(default_factory=dict)       # replicated arrays, whole, by dataset path
    own_rows: dict = field(default_factory=dict)   # per-rank arrays: this rank's row (absent beyond the saved world)

    @property
    def step(self) -> int:
        return int(self.attrs["step"])

    @property
    def world_size(self) -> int:
        return int(self.attrs["world_size"])


def _attr(value):
    """An HDF5 attribute as a plain Python value (bytes decoded, numpy scalars unwrapped)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def datasets(f) -> list:
    """Every dataset in the file as (path, dataset), sorted by path (the same order on every rank)."""
    import h5py

    found = []
    f.visititems(lambda name, obj: found.append(("/" + name, obj)) if isinstance(obj, h5py.Dataset) else None)
    return sorted(found, key=lambda t: t[0])


def header(f, path: str) -> dict:
    """Root attributes after checking format, version and completeness; CorruptCheckpoint otherwise."""
    attrs = {k: _attr(v) for k, v in f.attrs.items()}
    if attrs.get("format") != FORMAT_NAME:
        raise CorruptCheckpoint(f"{path}: not an hpctrain checkpoint (root attribute format="
                                f"{attrs.get('format')!r}, expected {FORMAT_NAME!r})")
    if attrs.get("format_version") != FORMAT_VERSION:
        raise CorruptCheckpoint(f"{path}: checkpoint format version {attrs.get('format_version')!r}; this "
                                f"hpctrain reads version {FORMAT_VERSION}")
    if attrs.get("complete") is not True:
        raise CorruptCheckpoint(f"{path}: incomplete (the writer did not finish)")
    for key in ("step", "world_size"):
        if not isinstance(attrs.get(key), int) or isinstance(attrs[key], bool) or attrs[key] < 0:
            raise CorruptCheckpoint(f"{path}: root attribute {key}={attrs.get(key)!r} is not a valid count")
    return attrs


def _open(path: str):
    import h5py

    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{path}: cannot be read ({exc.strerror or exc}); check that it exists on "
                                   f"every node and is readable") from None
    try:
        # no HDF5 file locks: readers never conflict, and Lustre/NFS often refuse flock
        return h5py.File(path, "r", locking=False)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"{path}: cannot be opened as HDF5 ({exc}); truncated or overwritten?") from None


def _check_dataset(d, path, name):
    """A plain numeric array of native byte order whose storage is all there (the writer
    never compresses: storage must equal the logical size, so a forged huge shape with
    no data behind it is refused before anything is read or allocated)."""
    if d.ndim == 0 or d.dtype.kind not in "fiub" or d.dtype.byteorder not in "=<|":
        raise CorruptCheckpoint(f"{path}: dataset {name} is not a little-endian numeric array ({d.dtype})")
    if d.id.get_storage_size() != d.size * d.dtype.itemsize or d.chunks is not None:
        raise CorruptCheckpoint(f"{path}: dataset {name} declares {d.size * d.dtype.itemsize} bytes but stores "
                                f"{d.id.get_storage_size()}: not written by hpctrain, or damaged")


def _stored_crc(d, path, name) -> int:
    if "crc32" not in d.attrs:
        raise CorruptCheckpoint(f"{path}: dataset {name} has no crc32 attribute")
    return int(d.attrs["crc32"])


def verify_file(path: str) -> dict:
    """Read every dataset of ``path`` and compare its CRC-32; returns the header. Serial, no MPI.

    Raises :class:`CorruptCheckpoint` naming the first problem.
    """
    with _reading(path) as f:
        attrs = header(f, path)
        for name, d in datasets(f):
            _check_dataset(d, path, name)
            row_bytes = max(1, d.dtype.itemsize * int(np.prod(d.shape[1:])))
            step = max(1, VERIFY_BLOCK_BYTES // row_bytes)
            parts = [(crc32_of(b), b.nbytes) for b in (d[lo:lo + step] for lo in range(0, d.shape[0], step))]
            got, want = combine_parts(parts), _stored_crc(d, path, name)
            if got != want:
                raise CorruptCheckpoint(f"{path}: dataset {name} fails its checksum (stored crc32 "
                                        f"{want:#010x}, computed {got:#010x}): the file is corrupt")
        return attrs


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


def _read_share(path: str, rank: int, size: int):
    """This rank's slices of every dataset, their CRC parts and its own per-rank rows."""
    with _reading(path) as f:
        attrs = header(f, path)
        slices, parts, own, meta = {}, [], {}, []
        for name, d in datasets(f):
            _check_dataset(d, path, name)
            per_rank = bool(d.attrs.get("per_rank", False))
            lo, hi = row_range(d.shape[0], rank, size)
            block = d[lo:hi]
            parts.append((crc32_of(block), block.nbytes))
            meta.append((name, d.shape, d.dtype.str, _stored_crc(d, path, name), per_rank))
            if per_rank:
                if rank < d.shape[0]:
                    own[name] = d[rank]
            else:
                slices[name] = block
        return attrs, meta, parts, slices, own


def load_checkpoint(path: str, world) -> LoadedCheckpoint:
    """Read and verify ``path`` on every rank; collective over ``world.comm``.

    Each rank reads and checksums 1/size of every dataset, the CRCs are
    combined and checked (the same verdict everywhere), then the replicated
    arrays are all-gathered whole. Raises :class:`CorruptCheckpoint` on every
    rank if any part fails.
    """
    comm, rank, size = world.comm, world.rank, world.size
    try:
        attrs, meta, parts, slices, own = _read_share(path, rank, size)
        failure = None
    except UnreadableCheckpoint as exc:
        attrs, meta, parts, slices, own, failure = None, None, None, None, None, ("unreadable", str(exc))
    except Exception as exc:  # noqa: BLE001 - any other failure: this rank cannot use the file
        text = str(exc) if isinstance(exc, CorruptCheckpoint) else f"{path}: {type(exc).__name__}: {exc}"
        attrs, meta, parts, slices, own, failure = None, None, None, None, None, ("corrupt", text)
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
    out = LoadedCheckpoint(path, attrs, own_rows=own)
    for name, shape, dtype, _, per_rank in meta:
        if not per_rank:
            out.full[name] = _allgather_rows(comm, slices[name], shape, np.dtype(dtype))
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


def _agreed(exc):
    """Mark an error that every rank raises alike (printed once by rank 0, no MPI_Abort)."""
    exc.agreed = True
    return exc


def header_of(path: str) -> dict:
    """The checked header of ``path`` (no data read); CorruptCheckpoint / UnreadableCheckpoint otherwise."""
    with _reading(path) as f:
        return header(f, path)


def inspect_file(path: str) -> tuple[dict, list]:
    """Root attributes and (path, shape, dtype, bytes, crc32, per_rank) per dataset, without reading data."""
    with _reading(path) as f:
        attrs = {k: _attr(v) for k, v in f.attrs.items()}
        rows = [(name, tuple(d.shape), str(d.dtype), int(d.size) * d.dtype.itemsize,
                 int(d.attrs["crc32"]) if "crc32" in d.attrs else None, bool(d.attrs.get("per_rank", False)))
                for name, d in datasets(f)]
        return attrs, rows

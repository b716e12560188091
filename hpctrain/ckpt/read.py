"""Reading checkpoints: verification (every byte against its CRC) and the parallel load.

Reads use plain serial h5py on every rank (read-only opens may share a file),
so resuming works with or without parallel HDF5. Nothing in a file is ever
executed or unpickled: only numeric datasets and plain attributes are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from .format import FORMAT_NAME, FORMAT_VERSION, combine_parts, crc32_of, row_range

VERIFY_BLOCK_BYTES = 64 << 20  # serial verification reads this much at a time


class CorruptCheckpoint(UserError):
    """A checkpoint that cannot be used: unreadable, truncated, incomplete or failing a checksum."""


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
    if not attrs.get("complete"):
        raise CorruptCheckpoint(f"{path}: incomplete (the writer did not finish)")
    for key in ("step", "world_size"):
        if not isinstance(attrs.get(key), int) or attrs[key] < 0:
            raise CorruptCheckpoint(f"{path}: root attribute {key}={attrs.get(key)!r} is not a valid count")
    return attrs


def _open(path: str):
    import h5py

    try:
        return h5py.File(path, "r")
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"{path}: cannot be opened as HDF5 ({exc}); truncated or overwritten?") from None


def _stored_crc(d, path, name) -> int:
    if "crc32" not in d.attrs:
        raise CorruptCheckpoint(f"{path}: dataset {name} has no crc32 attribute")
    return int(d.attrs["crc32"])


def verify_file(path: str) -> dict:
    """Read every dataset of ``path`` and compare its CRC-32; returns the header. Serial, no MPI.

    Raises :class:`CorruptCheckpoint` naming the first problem.
    """
    f = _open(path)
    try:
        try:
            attrs = header(f, path)
            for name, d in datasets(f):
                if d.ndim == 0 or d.dtype.kind not in "fiub":
                    raise CorruptCheckpoint(f"{path}: dataset {name} is not a numeric array")
                row_bytes = max(1, d.dtype.itemsize * int(np.prod(d.shape[1:])))
                step = max(1, VERIFY_BLOCK_BYTES // row_bytes)
                parts = [(crc32_of(b), b.nbytes) for b in (d[lo:lo + step] for lo in range(0, d.shape[0], step))]
                got, want = combine_parts(parts), _stored_crc(d, path, name)
                if got != want:
                    raise CorruptCheckpoint(f"{path}: dataset {name} fails its checksum (stored crc32 "
                                            f"{want:#010x}, computed {got:#010x}): the file is corrupt")
            return attrs
        except CorruptCheckpoint:
            raise
        except Exception as exc:  # noqa: BLE001 - any read failure means an unusable file
            raise CorruptCheckpoint(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    finally:
        f.close()


def _read_share(path: str, rank: int, size: int):
    """This rank's slices of every dataset, their CRC parts and its own per-rank rows."""
    f = _open(path)
    try:
        attrs = header(f, path)
        slices, parts, own, meta = {}, [], {}, []
        for name, d in datasets(f):
            if d.ndim == 0 or d.dtype.kind not in "fiub":
                raise CorruptCheckpoint(f"{path}: dataset {name} is not a numeric array")
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
    except CorruptCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CorruptCheckpoint(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    finally:
        f.close()


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
    except CorruptCheckpoint as exc:
        attrs, meta, parts, slices, own, failure = None, None, None, None, None, str(exc)
    everyone = comm.allgather((failure, meta, parts))
    failures = [f for f, _, _ in everyone if f]
    if failures:
        raise _agreed(CorruptCheckpoint(failures[0]))
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
        if per_rank:
            continue
        row = int(np.prod(shape[1:]))
        counts = [(hi - lo) * row for lo, hi in (row_range(shape[0], r, size) for r in range(size))]
        full = np.empty(int(np.prod(shape)), dtype=np.dtype(dtype))
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        comm.Allgatherv(np.ascontiguousarray(slices[name]).reshape(-1), [full, (counts, displs)])
        out.full[name] = full.reshape(shape)
    return out


def _agreed(exc):
    """Mark an error that every rank raises alike (printed once by rank 0, no MPI_Abort)."""
    exc.agreed = True
    return exc


def inspect_file(path: str) -> tuple[dict, list]:
    """Root attributes and (path, shape, dtype, bytes, crc32, per_rank) per dataset, without reading data."""
    f = _open(path)
    try:
        attrs = {k: _attr(v) for k, v in f.attrs.items()}
        rows = [(name, tuple(d.shape), str(d.dtype), int(d.size) * d.dtype.itemsize,
                 int(d.attrs["crc32"]) if "crc32" in d.attrs else None, bool(d.attrs.get("per_rank", False)))
                for name, d in datasets(f)]
        return attrs, rows
    except Exception as exc:  # noqa: BLE001
        raise CorruptCheckpoint(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    finally:
        f.close()

"""What a valid checkpoint file is, beyond its checksums: the errors, the header, the walk over
its datasets and the checks of its layout (docs/checkpoint-format.md). No data is read here.

The CRCs cover the arrays' bytes; everything else in the file is HDF5 metadata, which a corrupt
file may damage in ways HDF5 does not notice: a dataset turned into a named datatype (silently
missing), a link cycle, a root attribute emptied. :func:`check_layout` holds the file to what the
writer always makes, so such damage is a :class:`CorruptCheckpoint` like a failing checksum.
"""

from __future__ import annotations

import tomllib

import numpy as np

from ..errors import UserError
from .format import (FORMAT_NAME, OPTIMIZER_STATES, PER_RANK_GROUPS, READABLE_VERSIONS,
                     TRAINER_DATASETS, TRAINER_DTYPES, attrs_crc32)

MAX_OBJECTS, MAX_DEPTH = 1 << 20, 64  # a walk past either is round a link cycle (HDF5 would go on for ever)


class CorruptCheckpoint(UserError):
    """A checkpoint that cannot be used: truncated, incomplete, malformed or failing a checksum."""


class UnreadableCheckpoint(UserError):
    """A file the operating system will not let us read (permissions, missing on this node):
    not evidence of corruption, so ``--resume auto`` stops instead of skipping it."""


def attr_value(value):
    """An HDF5 attribute as a plain Python value (bytes decoded, numpy scalars unwrapped)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def datasets(f, path: str = "") -> list:
    """Every dataset in the file as (path, dataset), sorted by path (the same order on every rank).

    CorruptCheckpoint for an object that is neither group nor dataset (a damaged header can turn a
    dataset into a named datatype, which would silently drop it) and for a walk round a cycle."""
    import h5py

    found, problem, seen = [], [], [0]

    def visit(name, obj):
        seen[0] += 1
        if seen[0] > MAX_OBJECTS or name.count("/") >= MAX_DEPTH:
            problem.append(f"more than {MAX_OBJECTS} objects or {MAX_DEPTH} levels (a link cycle)")
        elif isinstance(obj, h5py.Dataset):
            found.append(("/" + name, obj))
        elif not isinstance(obj, h5py.Group):
            problem.append(f"/{name} is a {type(obj).__name__}, not a dataset or group")
        return True if problem else None  # anything but None stops the walk

    f.visititems(visit)
    if problem:
        raise CorruptCheckpoint(f"{path}: {problem[0]}: the file is corrupt")
    return sorted(found, key=lambda t: t[0])


def header(f, path: str) -> dict:
    """Root attributes after checking format, version and completeness; CorruptCheckpoint otherwise."""
    attrs = {k: attr_value(v) for k, v in f.attrs.items()}
    if attrs.get("format") != FORMAT_NAME:
        raise CorruptCheckpoint(f"{path}: not an hpctrain checkpoint (root attribute format="
                                f"{attrs.get('format')!r}, expected {FORMAT_NAME!r})")
    version = attrs.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CorruptCheckpoint(f"{path}: checkpoint format version {version!r}; this hpctrain reads versions "
                                f"{', '.join(map(str, READABLE_VERSIONS))}")
    if attrs.get("complete") is not True:
        raise CorruptCheckpoint(f"{path}: incomplete (the writer did not finish)")
    if version >= 2:  # version 1 files predate the root attributes' CRC
        want = attrs.get("attrs_crc32")
        if not isinstance(want, int) or isinstance(want, bool) or want != attrs_crc32(attrs):
            raise CorruptCheckpoint(f"{path}: its root attributes fail their checksum (attrs_crc32): the file "
                                    f"is corrupt")
    for key in ("step", "world_size"):
        if not isinstance(attrs.get(key), int) or isinstance(attrs[key], bool) or attrs[key] < 0:
            raise CorruptCheckpoint(f"{path}: root attribute {key}={attrs.get(key)!r} is not a valid count")
    return attrs


_IN_CONFIG = {"optimizer": ("optim", "name"), "dtype": ("train", "dtype"), "compress": ("dist", "compress"),
              "compress_scope": ("dist", "compress_scope")}  # root attribute -> where the stored config has it


def check_layout(path: str, attrs: dict, dsets: list) -> None:
    """What the CRCs cannot see, as the writer always makes it: each /optim/<state> mirrors /model,
    per-rank arrays are exactly those under PER_RANK_GROUPS with one row per saved rank; and in a
    training run's checkpoint the trainer's arrays and the optimizer's states are all there, in the
    writer's dtypes, and the root attributes agree with the stored config (they are stored twice)."""
    model = {n[len("/model/"):] for n, _ in dsets if n.startswith("/model/")}
    states = {}
    for name, d in dsets:
        parts = name.split("/", 3)  # "", "optim", state, parameter
        if parts[1] == "optim" and len(parts) == 4:
            states.setdefault(parts[2], set()).add(parts[3])
        if bool(d.attrs.get("per_rank", False)) != (parts[1] in PER_RANK_GROUPS):
            raise CorruptCheckpoint(f"{path}: dataset {name} has a wrong per_rank flag: the file is corrupt")
        if parts[1] in PER_RANK_GROUPS and d.shape[0] != attrs["world_size"]:
            raise CorruptCheckpoint(f"{path}: per-rank dataset {name} has {d.shape[0]} rows, the root attribute "
                                    f"world_size={attrs['world_size']}: the file is corrupt")
        if _is_parameter(name) and d.dtype.kind != "f":
            raise CorruptCheckpoint(f"{path}: dataset {name} holds {d.dtype}, not floating point: the file is corrupt")
    for state, params in sorted(states.items()):
        if params != model:
            raise CorruptCheckpoint(f"{path}: /optim/{state} and /model hold different parameters "
                                    f"({', '.join(sorted(params ^ model)[:3])}): the file is corrupt")
    names = {n for n, _ in dsets}
    # a training run's checkpoint, recognised by any of several marks (damage may erase one or two)
    if not any(a in attrs for a in ("config", *_IN_CONFIG)) and not names & set(TRAINER_DATASETS[:2]):
        return  # written by write_checkpoint for a tool or a test: nothing more is known
    missing = [n for n in TRAINER_DATASETS if n not in names] + ([] if model else ["/model/*"])
    missing += [] if "config" in attrs else ["the root attribute config"]
    want = OPTIMIZER_STATES.get(attrs.get("optimizer"))
    missing += [f"/optim/{s}/*" for s in want or () if s not in states]
    if missing:
        raise CorruptCheckpoint(f"{path}: lacks {', '.join(missing)}, which every training checkpoint holds: "
                                f"the file is corrupt")
    try:
        config = tomllib.loads(str(attrs["config"]))  # data only: nothing in a file is executed
    except (ValueError, RecursionError):  # TOMLDecodeError is a ValueError
        raise CorruptCheckpoint(f"{path}: its stored config is not valid TOML: the file is corrupt") from None
    for attr, (section, key) in _IN_CONFIG.items():
        table = config.get(section)
        stored = table.get(key) if isinstance(table, dict) else None
        if attrs.get(attr) != stored:  # both absent only in files older than the setting
            raise CorruptCheckpoint(f"{path}: root attribute {attr}={attrs.get(attr)!r} disagrees with the stored "
                                    f"config ({section}.{key}={stored!r}): the file is corrupt")
    for name, d in dsets:  # dtype agrees with the config now, so it names a real dtype
        want = attrs.get("dtype") if _is_parameter(name) else TRAINER_DTYPES.get(
            "/compress/*" if name.startswith("/compress/") and name != "/compress/lengths" else name)
        if want is not None and d.dtype != np.dtype(want):
            raise CorruptCheckpoint(f"{path}: dataset {name} holds {d.dtype}, a training checkpoint stores "
                                    f"{want} there: the file is corrupt")


def _is_parameter(name: str) -> bool:
    """/model/... or /optim/<state>/...: parameters and optimizer state, in train.dtype."""
    return name.startswith("/model/") or (name.startswith("/optim/") and name.count("/") >= 3)


def checked(f, path: str) -> tuple[dict, list]:
    """The header and the datasets of the open file ``f``, after every check that needs no data:
    :func:`header`, :func:`check_dataset` on each dataset, :func:`check_layout`."""
    attrs = header(f, path)
    dsets = datasets(f, path)
    for name, d in dsets:
        check_dataset(d, path, name)
    check_layout(path, attrs, dsets)
    return attrs, dsets


def check_step(path: str, attrs: dict, position) -> None:
    """The root attribute step against /data/position (which its CRC covers)."""
    if position is not None and int(position[0]) != attrs["step"]:
        raise CorruptCheckpoint(f"{path}: root attribute step={attrs['step']} but /data/position says step "
                                f"{int(position[0])}: the file is corrupt")


def check_dataset(d, path, name):
    """A plain numeric array of native byte order whose storage is all there (the writer
    never compresses: storage must equal the logical size, so a forged huge shape with
    no data behind it is refused before anything is read or allocated)."""
    if d.ndim == 0 or d.dtype.kind not in "fiub" or d.dtype.byteorder not in "=<|":
        raise CorruptCheckpoint(f"{path}: dataset {name} is not a little-endian numeric array ({d.dtype})")
    if d.id.get_storage_size() != d.size * d.dtype.itemsize or d.chunks is not None:
        raise CorruptCheckpoint(f"{path}: dataset {name} declares {d.size * d.dtype.itemsize} bytes but stores "
                                f"{d.id.get_storage_size()}: not written by hpctrain, or damaged")


def stored_crc(d, path, name) -> int:
    if "crc32" not in d.attrs:
        raise CorruptCheckpoint(f"{path}: dataset {name} has no crc32 attribute")
    return int(d.attrs["crc32"])

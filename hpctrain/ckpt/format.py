"""The checkpoint file format: names, layout constants and checksums (docs/checkpoint-format.md).

One HDF5 file per checkpoint, ``ckpt-<step:08d>.h5``, written as ``.ckpt-<step:08d>.h5.tmp`` and
renamed when complete, so a name that matches :data:`NAME_RE` is a finished write (a crash leaves
only a dot-file).

Every dataset carries ``crc32``, zlib's CRC-32 of the array's bytes in C order as stored
(little-endian). Ranks write disjoint boxes, and the whole array's CRC is put together from theirs
without any rank reading all of it (:mod:`.crc`; :func:`crc32_combine` here is the pure Python GF(2)
shift of zlib's ``crc32_combine``, for consecutive parts and where zlib's C operators are missing).
The CRC is computed with ISA-L (the ``isal`` package: the same CRC-32, several times faster) when
installed, else with zlib.
"""

from __future__ import annotations

import json
import os
import re
import zlib

import numpy as np

try:  # the same polynomial and values as zlib.crc32, several times faster
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is installed by scripts/setup.sh
    _crc32 = zlib.crc32

FORMAT_NAME = "hpctrain-checkpoint"
FORMAT_VERSION = 2  # 2 added attrs_crc32; version 1 files are still read
READABLE_VERSIONS = (1, 2)
NAME_RE = re.compile(r"^ckpt-(\d{8,})\.h5$")
# groups every checkpoint has (compress: per-rank compressor state, may be empty)
GROUPS = ("model", "optim", "compress", "data", "rng")
PER_RANK_GROUPS = ("rng", "compress")  # arrays of one row per saved rank (ckpt/state.py); the rest are replicated
# what every training run's checkpoint holds besides /model/* (ckpt/state.py training_state), and the
# /optim/<state>/* groups of each optim.name (hpctrain/optim state()); the readers check both are there
TRAINER_DATASETS = ("/data/position", "/optim/step_count", "/rng/pcg64")
# their dtypes, and those of /compress (float32 residuals, int64 lengths); /model and /optim/<state>
# hold train.dtype (the root attribute dtype). A flipped bit can turn a float type into an integer
# type of the same size, which the CRC of the unchanged bytes cannot see: the readers check these.
TRAINER_DTYPES = {"/data/position": "int64", "/optim/step_count": "int64", "/rng/pcg64": "uint64",
                  "/compress/lengths": "int64", "/compress/*": "float32",
                  "/precision/loss_scale": "float64"}   # fp16 runs only: [scale, clean steps, overflows]
OPTIMIZER_STATES = {"sgd": ("momentum",), "adamw": ("exp_avg", "exp_avg_sq"), "lamb": ("exp_avg", "exp_avg_sq"),
                    "lars": ("momentum",)}


def parameter_path(group: str, name: str) -> str:
    """'fc0.weight' in group 'model' -> '/model/fc0/weight' (a group per layer)."""
    return f"/{group}/" + "/".join(name.split("."))


def file_name(step: int) -> str:
    return f"ckpt-{step:08d}.h5"


def temp_name(step: int) -> str:
    """Where a checkpoint is written before the commit; never matches :data:`NAME_RE`."""
    return f".ckpt-{step:08d}.h5.tmp"


def attrs_crc32(attrs: dict) -> int:
    """CRC-32 of the root attributes (the stored ``attrs_crc32`` attribute), over every attribute but
    itself and ``complete`` (written last, and checked on its own), as canonical JSON: sorted keys,
    plain values (str, int, float, bool) as the readers decode them. Covers what the array CRCs do
    not: the stored config, step, epoch, world size."""
    def plain(v):
        if isinstance(v, bytes):
            return v.decode("utf-8", "replace")
        return v.item() if isinstance(v, np.generic) else v.tolist() if isinstance(v, np.ndarray) else v

    values = {k: plain(v) for k, v in attrs.items() if k not in ("attrs_crc32", "complete")}
    text = json.dumps(values, sort_keys=True, ensure_ascii=True, separators=(",", ":"), allow_nan=True)
    return zlib.crc32(text.encode("ascii")) & 0xFFFFFFFF


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every committed checkpoint name in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names if (m := NAME_RE.match(n))]
    return sorted(found, reverse=True)


def row_range(rows: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [lo, hi) of a logical array that ``rank`` of ``size`` writes or reads (the first rows % size ranks take one more)."""
    base, extra = divmod(rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def crc32_of(array: np.ndarray) -> int:
    """zlib CRC-32 of the array's C-order bytes (made contiguous and little-endian first)."""
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return _crc32(a.reshape(-1).view(np.uint8)) & 0xFFFFFFFF


# ---- crc32_combine: crc(A + B) from crc(A), crc(B) and len(B) ------------------------
# Appending len(B) zero bytes to A is a linear map on the 32-bit CRC register over
# GF(2); it is built by repeated squaring of the one-zero-bit operator.
_POLY = 0xEDB88320


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


_ZERO_BYTES_OPS: list = []  # [k]: the operator for 2^k zero bytes, built once (64 matrices)


def _zero_bytes_op(k: int) -> list[int]:
    if not _ZERO_BYTES_OPS:
        op = _square(_square(_square([_POLY] + [1 << n for n in range(31)])))  # one zero byte (8 bits)
        for _ in range(64):
            _ZERO_BYTES_OPS.append(op)
            op = _square(op)
    return _ZERO_BYTES_OPS[k]


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of A followed by B, given crc32(A), crc32(B) and B's length in bytes."""
    k = 0
    while len_b > 0:
        if len_b & 1:
            crc_a = _times(_zero_bytes_op(k), crc_a)
        len_b >>= 1
        k += 1
    return (crc_a ^ crc_b) & 0xFFFFFFFF


def combine_parts(parts: list[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive parts given as (crc, n_bytes), in order."""
    total = 0
    for crc, n in parts:
        total = crc32_combine(total, crc, n) if n else total
    return total

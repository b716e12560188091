"""Token files: open and check them, cut a stream into windows, read this rank's windows per step.

File format (docs/data-format.md, written by :mod:`.text`): ``/train`` and
``/val`` are 1-D integer token streams, the root attribute ``vocab_size``
bounds the tokens, ``format = "hpctrain-tokens"``. Window i of a stream is
``stream[i*T : i*T + T + 1]`` (T = context): T inputs and their T next-token
targets from one read. Which windows a rank reads at each step is
:mod:`.sampler`'s rule, the same one the tabular rows use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import DataError
from .sampler import DistributedSampler

FORMAT_NAME = "hpctrain-tokens"
FORMAT_VERSION = 1
MAX_VOCAB = 2**31 - 1    # tokens index the embedding with 32-bit ints in the kernels
CHECK_TOKENS = 1 << 24   # tokens per slice of the range check (16 MiB of uint8; bounded memory)


@dataclass
class TokenData:
    """An open token file. ``train`` and ``val`` are 1-D array-likes that support slicing: an
    ``np.memmap`` of the dataset when it is stored contiguous and unfiltered (no copy, the page
    cache is shared by the ranks of a node), else the h5py dataset itself. ``attrs`` holds the
    root attributes. Use the streams only while the file is open."""

    path: str
    file: object
    vocab_size: int
    train: object
    val: object
    attrs: dict

    def close(self):
        self.file.close()


def open_tokens(path: str, what: str = "data.train") -> TokenData:
    """Open and check the token file ``path``; raise :class:`DataError` naming the problem and the fix.

    ``what`` names the setting the path came from (``data.train`` or ``data.eval``).
    Every rank calls it; the checks read the whole of both streams once, in slices.
    """
    import h5py

    make = f"'python -m hpctrain data text --out {path or 'data/text.h5'}'"
    if not path:
        raise DataError(f"{what} is empty; set it to a token file (make one with {make})")
    if not os.path.exists(path):
        raise DataError(f"{what}: token file {path!r} not found; create one with {make} or point {what} at yours")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{what}: {path!r} is not a readable HDF5 file ({exc}); remake it with {make}") from None
    try:
        fmt = file_format(f.attrs)
        if fmt != FORMAT_NAME:
            if "x" in f and "y" in f:
                raise DataError(f"{what}: {path!r} is a tabular classification file (/x, /y) for "
                                f"model.kind = \"mlp\"; a gpt needs a token file: make one with {make}")
            raise DataError(f"{what}: {path!r} is not a token file (root attribute format={fmt!r}, expected "
                            f"{FORMAT_NAME!r}); make one with {make}")
        version = f.attrs.get("format_version", FORMAT_VERSION)
        if int(version) > FORMAT_VERSION:
            raise DataError(f"{what}: {path!r} has format_version {int(version)}, newer than this hpctrain "
                            f"reads ({FORMAT_VERSION}); upgrade hpctrain or remake the file with {make}")
        for split in ("train", "val"):
            d = f.get(split)
            if not isinstance(d, h5py.Dataset) or d.ndim != 1 or d.dtype.kind not in "iu":
                got = "missing" if d is None else (f"{d.shape} {d.dtype}" if isinstance(d, h5py.Dataset) else "a group")
                raise DataError(f"{what}: {path}:/{split} must be a 1-D integer token stream, got {got}; "
                                f"remake the file with {make}")
        vocab = _vocab_size(f.attrs.get("vocab_size"), f"{what}: {path}")
        streams = {split: _array(path, f[split]) for split in ("train", "val")}
        for split, stream in streams.items():
            _check_range(stream, vocab, f"{what}: {path}:/{split}")
        return TokenData(path, f, vocab, streams["train"], streams["val"], dict(f.attrs))
    except DataError:
        f.close()
        raise


def file_format(attrs) -> str | None:
    """The root attribute ``format`` of an open HDF5 file as str, or None when absent or not a string."""
    value = attrs.get("format")
    if isinstance(value, (bytes, np.bytes_)):  # h5py returns fixed-length strings as bytes
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _vocab_size(value, where: str) -> int:
    """The vocab_size attribute as an int in [2, MAX_VOCAB], or a DataError saying how to set it."""
    v = value.item() if isinstance(value, np.ndarray) and value.size == 1 else value
    v = v.item() if isinstance(v, np.generic) else v
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not 2 <= v <= MAX_VOCAB:
        raise DataError(f"{where}: root attribute vocab_size={v!r} must be an integer from 2 to {MAX_VOCAB} "
                        f"(256 for bytes); set it (h5py: f.attrs['vocab_size'] = V)")
    return v


def _array(path: str, d):
    """``d`` as an np.memmap when its bytes lie contiguous in ``path``, else ``d`` itself."""
    offset = d.id.get_offset()  # None when not allocated (e.g. empty) or stored elsewhere
    if d.chunks is None and d.compression is None and d.external is None and offset is not None and len(d):
        return np.memmap(path, dtype=d.dtype, mode="r", offset=offset, shape=d.shape)
    return d


def _check_range(stream, vocab: int, where: str) -> None:
    """Every token in [0, vocab): an out-of-range token would index past the embedding table
    (numba does not bounds-check), so it is refused before training. Read in slices."""
    for start in range(0, len(stream), CHECK_TOKENS):
        part = np.asarray(stream[start:start + CHECK_TOKENS])
        lo, hi = int(part.min()), int(part.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            at = start + int(np.flatnonzero(part == bad)[0])
            raise DataError(f"{where}: token {bad} at position {at} is outside 0..{vocab - 1} "
                            f"(vocab_size={vocab}); fix the vocab_size attribute or remake the file")


class TokenWindows:
    """Non-overlapping windows of ``context + 1`` tokens of one stream.

    Window i is ``stream[i*T : i*T + T + 1]`` (T = context); n = (len - 1) // T
    windows fit (the tail after the last one is never read). ``what`` names the
    file's setting for messages (``data.train``); ``split`` names the stream
    (``train`` or ``val``; taken from an h5py dataset's name when left out).
    """

    def __init__(self, stream, context: int, what: str = "data.train", split: str = ""):
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        self.stream, self.context = stream, context
        length = len(stream)
        self.n = max(0, (length - 1) // context)
        split = split or getattr(stream, "name", "").lstrip("/") or "token"
        if self.n < 1:
            raise DataError(f"{what}: the {split} stream has {length} tokens, fewer than context + 1 = "
                            f"{context + 1}; lower model.context or use more text")
        if isinstance(stream, np.ndarray):
            # window i as row i of a strided (n, T + 1) view: one fancy index reads a batch (rows overlap by 1)
            step = stream.strides[0]
            self._rows = np.lib.stride_tricks.as_strided(stream, (self.n, context + 1), (context * step, step),
                                                         writeable=False)
        else:
            self._rows = None

    def read(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of the windows ``indices``, in the order given: int64 C-contiguous arrays of shape
        (len(indices), context); y is x shifted by one token (the next-token targets)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"window index out of range 0..{self.n - 1}: {idx.min()}..{idx.max()}")
        c = self.context
        if self._rows is not None:
            w = self._rows[idx]
        else:
            w = np.empty((len(idx), c + 1), dtype=self.stream.dtype)
            for k, i in enumerate(idx):  # one slab read per window (HDF5 slices are cheap to describe)
                w[k] = self.stream[i * c:i * c + c + 1]
        return np.ascontiguousarray(w[:, :-1], dtype=np.int64), np.ascontiguousarray(w[:, 1:], dtype=np.int64)


class TokenBatchReader:
    """This rank's (x, y) windows of a global step: the token twin of :class:`.tabular.BatchReader`.

    ``sampler`` is a :class:`.sampler.DistributedSampler` over ``windows.n``, so N
    ranks read exactly the windows one rank with the N-times batch would, and a
    fresh reader at any step gives that step's batch (resuming mid-epoch).
    """

    def __init__(self, windows: TokenWindows, sampler: DistributedSampler):
        if sampler.n != windows.n:
            raise ValueError(f"the sampler covers {sampler.n} items but there are {windows.n} windows")
        self.windows, self.sampler = windows, sampler

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y), each (b, context) int64, b = the per-rank batch, for 0-based global ``step``."""
        return self.windows.read(self.sampler.indices(step))


def eval_indices(n_windows: int, max_windows: int) -> np.ndarray:
    """The windows an evaluation uses, sorted and unique: all of them when ``max_windows`` is 0 or
    >= ``n_windows``, else ``max_windows`` of them spread evenly over the split (the middle of each
    of max_windows equal parts; the same ones every time). Each rank then takes a contiguous shard
    (:func:`.sampler.shard_range`)."""
    if n_windows < 0 or max_windows < 0:
        raise ValueError(f"n_windows={n_windows} and max_windows={max_windows} must be >= 0")
    if max_windows == 0 or max_windows >= n_windows:
        return np.arange(n_windows, dtype=np.int64)
    # integer arithmetic: parts are >= 1 window wide, so the picks strictly increase
    parts = np.arange(max_windows, dtype=np.int64)
    return (2 * parts + 1) * n_windows // (2 * max_windows)

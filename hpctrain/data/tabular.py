"""HDF5 classification data: the tabular format (x/y), its checks, and per-rank batch reading.

File format (docs/data-format.md): ``/x`` float [N, D], ``/y`` integer [N],
root attribute ``n_classes`` (and ``format``/``format_version`` when written by
hpctrain). Which rows a rank reads is :mod:`.sampler`'s rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import DataError
from .sampler import DistributedSampler
from .tokens import FORMAT_NAME as TOKENS_FORMAT, file_format

FORMAT_NAME = "hpctrain-classification"
FORMAT_VERSION = 1
MAX_READ_AMPLIFICATION = 8  # read whole chunks when they hold <= 8x the rows asked for


@dataclass
class Dataset:
    """An open HDF5 dataset: ``x`` (N, D) and ``y`` (N,) are h5py datasets (read lazily)."""

    path: str
    file: object
    x: object
    y: object
    n: int
    dim: int
    n_classes: int

    def close(self):
        self.file.close()


def open_dataset(path: str, what: str = "data.train") -> Dataset:
    """Open and check ``path``; raise :class:`DataError` naming the problem and the fix."""
    import h5py

    if not path:
        raise DataError(f"{what} is empty; set it to an HDF5 file with /x and /y")
    if not os.path.exists(path):
        raise DataError(f"{what}: dataset {path!r} not found; create one with "
                        f"'python -m hpctrain data synth --out {path}' or point {what} at your file")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{what}: {path!r} is not a readable HDF5 file ({exc}); "
                        f"regenerate it or check the path") from None
    try:
        missing = [k for k in ("x", "y") if k not in f or not isinstance(f[k], h5py.Dataset)]
        if missing and file_format(f.attrs) == TOKENS_FORMAT:
            raise DataError(f"{what}: {path!r} is a token file (format {TOKENS_FORMAT!r}) for model.kind = "
                            f"\"gpt\"; set model.kind = \"gpt\" to train on it, or give a classification "
                            f"file with /x and /y ('python -m hpctrain data synth' or 'data import')")
        if missing:
            raise DataError(f"{what}: {path!r} lacks dataset(s) {', '.join('/' + m for m in missing)}; "
                            f"expected /x float [N, D] and /y integer [N] (docs/data-format.md)")
        x, y = f["x"], f["y"]
        if x.ndim != 2 or x.dtype.kind != "f":
            raise DataError(f"{what}: {path}:/x must be a 2-D float array [N, D], got shape {x.shape} {x.dtype}; "
                            + _fix(x, "x", "float32 features (x.astype('float32'); encode text or categories "
                                   "as numbers first)"))
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise DataError(f"{what}: {path}:/y must be a 1-D integer array [N], got shape {y.shape} {y.dtype}; "
                            + _fix(y, "y", "0-based class indices as integers (y.astype('int64'))"))
        if len(y) != len(x):
            raise DataError(f"{what}: {path}: /x has {len(x)} rows but /y has {len(y)}; they must match")
        if x.shape[1] == 0:
            raise DataError(f"{what}: {path}:/x has 0 features per sample; store at least one column")
        if "n_classes" not in f.attrs:
            raise DataError(f"{what}: {path} has no root attribute n_classes; add it "
                            f"(h5py: f.attrs['n_classes'] = C)")
        n_classes = _n_classes(f.attrs["n_classes"], f"{what}: {path}")
        if len(y) == 0:
            raise DataError(f"{what}: {path} has no samples")
        lo, hi = _label_range(y)
        if lo < 0 or hi >= n_classes:
            raise DataError(f"{what}: {path}: labels span [{lo}, {hi}] but n_classes={n_classes} allows "
                            f"only 0..{n_classes - 1}; relabel (0-based) or fix the n_classes attribute")
        return Dataset(path, f, x, y, len(x), x.shape[1], n_classes)
    except DataError:
        f.close()
        raise


def _fix(d, name: str, want: str) -> str:
    """The fix for a dataset of the wrong shape or type, worded for what it is."""
    if d.ndim == 2 and name == "y" and d.shape[1] == 1:
        return "store it flat (y.reshape(-1)), as 0-based class indices"
    if d.ndim == 2 and name == "y":
        return "store the class index per sample (e.g. one-hot rows -> y.argmax(axis=1)) as integers"
    if d.ndim != 2 and name == "x":
        return "store one row per sample (x.reshape(len(x), -1))"
    return f"store {want}, or regenerate the file ('python -m hpctrain data synth')"


MAX_CLASSES = 2**31 - 1  # labels index the logits with 32-bit ints in the kernels


def _n_classes(value, where: str) -> int:
    """The n_classes attribute as an int in [2, MAX_CLASSES], or a DataError saying how to set it."""
    v = value.item() if isinstance(value, np.ndarray) and value.size == 1 else value
    v = v.item() if isinstance(v, np.generic) else v
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not 2 <= v <= MAX_CLASSES:
        raise DataError(f"{where}: root attribute n_classes={v!r} must be an integer from 2 to {MAX_CLASSES}; "
                        f"set it to the number of classes (h5py: f.attrs['n_classes'] = C)")
    return v


def _label_range(y, rows_per_read: int = 1 << 20) -> tuple[int, int]:
    """(min, max) label, read in slices so huge files need bounded memory.

    Out-of-range labels would index past a row of logits in the loss kernel
    (numba does not bounds-check), so they are refused before training.
    """
    lo, hi = None, None
    for start in range(0, len(y), rows_per_read):
        part = y[start:start + rows_per_read]
        lo = int(part.min()) if lo is None else min(lo, int(part.min()))
        hi = int(part.max()) if hi is None else max(hi, int(part.max()))
    return lo, hi


def read_rows(ds: Dataset, rows: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """x[rows], y[rows] in the order given.

    HDF5 wants increasing indices, so rows are read sorted and put back in
    order. A point-wise (fancy) read costs microseconds per row; when the rows
    fill the chunks they touch well enough (at most MAX_READ_AMPLIFICATION
    times more rows than asked for), whole chunk runs are read as contiguous
    slices instead, which is what HDF5 does underneath anyway.
    """
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    x = np.empty((len(rows), ds.dim), dtype=dtype)
    y = np.empty(len(rows), dtype=np.int64)
    chunk_rows = ds.x.chunks[0] if ds.x.chunks else ds.n
    chunks = np.unique(sorted_rows // chunk_rows)
    if len(chunks) * chunk_rows <= MAX_READ_AMPLIFICATION * len(rows):
        # runs of consecutive chunks -> one contiguous slab read each
        breaks = np.flatnonzero(np.diff(chunks) > 1) + 1
        for run in np.split(chunks, breaks):
            lo, hi = run[0] * chunk_rows, min(ds.n, (run[-1] + 1) * chunk_rows)
            take = (sorted_rows >= lo) & (sorted_rows < hi)
            local = sorted_rows[take] - lo
            x[order[take]] = ds.x[lo:hi][local]
            y[order[take]] = ds.y[lo:hi][local]
    else:
        x[order] = ds.x[sorted_rows]
        y[order] = ds.y[sorted_rows]
    return x, y


class BatchReader:
    """This rank's batches, read ahead for ``window`` steps at a time (never across an epoch).

    One read of a window's rows amortises HDF5's per-call cost; only this
    rank's rows are requested. ``batch(step)`` returns (x, y) on the host.
    """

    def __init__(self, ds: Dataset, sampler: DistributedSampler, dtype, window_rows: int = 16384):
        self.ds, self.sampler, self.dtype = ds, sampler, dtype
        self.window = max(1, window_rows // sampler.batch)
        self._first, self._x, self._y = None, None, None

    def batch(self, step: int):
        b = self.sampler.batch
        if self._first is None or not self._first <= step < self._first + len(self._y) // b:
            epoch, s = self.sampler.position(step)
            steps = min(self.window, self.sampler.steps_per_epoch - s)
            rows = np.concatenate([self.sampler.indices(step + k) for k in range(steps)])
            self._x, self._y = read_rows(self.ds, rows, self.dtype)
            self._first = step
        k = step - self._first
        return self._x[k * b:(k + 1) * b], self._y[k * b:(k + 1) * b]

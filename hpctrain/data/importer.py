"""``data import``: a user's own NumPy arrays (x, y) -> the tabular classification format.

The file is written as :mod:`.synth` writes one (float32 /x chunked by rows,
int64 /y, attributes format, format_version, n_classes, n_features) to a
temporary name, checked with :func:`.tabular.open_dataset` (the checks every
training run makes), and only then renamed to the output. ``.npy`` inputs are
memory-mapped and copied in blocks of rows, so files larger than memory import.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from ..errors import DataError
from .tabular import FORMAT_NAME, FORMAT_VERSION, MAX_CLASSES, open_dataset

CHUNK_ROWS = 4096            # rows per HDF5 chunk, as synth writes them (the batch reader reads chunk runs)
MAX_CHUNK_BYTES = 4 << 20    # ... but at most 4 MiB per chunk for wide rows (HDF5's chunk cache is small)
BLOCK_BYTES = 64 << 20       # rows copied per pass: bounded memory for any N


def load_arrays(x_path: str = "", y_path: str = "", npz: str = "") -> tuple[object, object, str]:
    """(x, y, source) from ``--x``/``--y`` .npy files (memory-mapped) or one ``--npz`` with arrays x and y."""
    if npz:
        if x_path or y_path:
            raise DataError("data import: give either --npz F.npz or --x X.npy --y Y.npy, not both")
        archive = _load(npz)
        if isinstance(archive, np.ndarray):
            raise DataError(f"data import: {npz!r} is a single .npy array; pass it as --x or --y")
        missing = [k for k in ("x", "y") if k not in archive.files]
        if missing:
            raise DataError(f"data import: {npz!r} has arrays {archive.files} but not {' and '.join(missing)}; "
                            f"save them by name (np.savez(F, x=x, y=y))")
        # a .npz member cannot be memory-mapped: x and y are read whole (use .npy files for huge data)
        return archive["x"], archive["y"], os.path.basename(npz)
    if not (x_path and y_path):
        raise DataError("data import: give --x X.npy and --y Y.npy (or --npz F.npz holding arrays x and y)")
    x, y = _load(x_path), _load(y_path)
    for flag, a in (("--x", x), ("--y", y)):
        if not isinstance(a, np.ndarray):
            raise DataError(f"data import: {flag} is a .npz archive; pass it as --npz (arrays named x and y)")
    return x, y, f"{os.path.basename(x_path)}, {os.path.basename(y_path)}"


def _load(path: str):
    if not os.path.exists(path):
        raise DataError(f"data import: {path!r} not found; check the path")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"data import: {path!r} is not a NumPy .npy/.npz file without pickled objects "
                        f"({exc}); save it with np.save / np.savez") from None


def check_arrays(x, y) -> None:
    """Refuse what the tabular format cannot hold, naming the fix (before anything is written)."""
    if x.dtype.kind not in "biuf":
        raise DataError(f"data import: x has dtype {x.dtype}; features must be numbers: encode text or "
                        f"categories as numbers first (e.g. one-hot columns)")
    if x.ndim < 2:
        raise DataError(f"data import: x has shape {x.shape}; it needs one row per sample: reshape it "
                        f"(x.reshape(-1, 1) for one feature per sample)")
    if y.ndim != 1:
        raise DataError(f"data import: y has shape {y.shape}; it needs one class index per sample "
                        f"(y.reshape(-1), or y.argmax(axis=1) for one-hot rows)")
    if y.dtype.kind not in "biuf":
        raise DataError(f"data import: y has dtype {y.dtype}; labels must be 0-based integer class indices "
                        f"(names -> indices: np.unique(y, return_inverse=True)[1])")
    if len(x) != len(y):
        raise DataError(f"data import: x has {len(x)} rows but y has {len(y)} labels; they must match")
    if len(x) == 0 or x[0].size == 0:
        raise DataError(f"data import: x has shape {x.shape}; it needs at least one sample and one feature")


def import_arrays(out: str, x, y, classes: int = 0, source: str = "") -> dict:
    """Write ``x`` (N, ...) numeric and ``y`` (N,) integer labels to ``out``; return its attributes.

    x becomes float32 (N, D), D = the product of the trailing dimensions; a
    float y is accepted when every value is integral (cast to int64). n_classes
    is ``classes`` or max(y) + 1. Raises :class:`DataError` naming the fix.
    """
    import h5py

    check_arrays(x, y)
    n, dim = len(x), int(np.prod(x.shape[1:]))
    n_classes = _n_classes(y, classes)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        chunk = max(1, min(n, CHUNK_ROWS, MAX_CHUNK_BYTES // (4 * dim)))
        block = max(chunk, BLOCK_BYTES // (4 * dim) // chunk * chunk)  # whole chunks per pass
        counts = np.zeros(n_classes, dtype=np.int64)
        with h5py.File(tmp, "w") as f:
            xs = f.create_dataset("x", (n, dim), dtype="float32", chunks=(chunk, dim))
            ys = f.create_dataset("y", (n,), dtype="int64", chunks=(min(n, CHUNK_ROWS),))
            for start in range(0, n, block):
                part = np.asarray(x[start:start + block], dtype=np.float32).reshape(-1, dim)
                if not np.isfinite(part).all():
                    row = start + int(np.flatnonzero(~np.isfinite(part).all(axis=1))[0])
                    raise DataError(f"data import: x has NaN or Inf in row {row}; fill or drop such rows first")
                xs[start:start + len(part)] = part
                labels = np.asarray(y[start:start + block]).astype(np.int64)  # integral: checked above
                ys[start:start + len(labels)] = labels
                counts += np.bincount(labels, minlength=n_classes)
            attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "n_classes": n_classes,
                     "n_features": dim, "generator": "import", "source": source, "class_counts": counts}
            f.attrs.update(attrs)
        try:
            open_dataset(tmp, "data import").close()  # the same checks a training run makes
        except DataError as exc:
            raise DataError(str(exc).replace(tmp, out)) from None
        os.replace(tmp, out)
        return attrs
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _n_classes(y, classes: int) -> int:
    """``classes`` or max(y) + 1, after checking every label is a whole number >= 0 (in blocks)."""
    lo, hi = 0, -1
    step = BLOCK_BYTES // 8
    for start in range(0, len(y), step):
        part = np.asarray(y[start:start + step])
        if part.dtype.kind == "f":
            bad = ~(np.isfinite(part) & (part == np.round(part)))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise DataError(f"data import: y[{start + i}] = {part[i]!r} is not a whole number; labels must "
                                f"be class indices (a float y is cast only when every value is integral)")
        lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
    if lo < 0:
        raise DataError(f"data import: y has label {lo}; labels must be 0-based class indices (0 .. C-1)")
    if classes and classes <= hi:
        raise DataError(f"data import: --classes {classes} but y has label {hi}; use --classes {hi + 1} or more, "
                        f"or leave it out (max(y) + 1)")
    n_classes = classes or hi + 1
    if not 2 <= n_classes <= MAX_CLASSES:
        raise DataError(f"data import: {n_classes} classes (labels span {lo}..{hi}); a classifier needs 2 to "
                        f"{MAX_CLASSES}: pass --classes C if this file holds only some of them, or relabel")
    return n_classes

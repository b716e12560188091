"""Byte-level token files from text: the corpus walk, the train/val split, the baselines, the writer.

Each document (a file) becomes its bytes; a split's stream is its documents'
bytes concatenated in order (vocabulary 256, no tokenizer to train or ship).
A document goes to /val iff a hash of its relative path says so, so the split
does not move when files are added or the corpus is walked in another order.
The same inputs give the same file, byte for byte. Format: docs/data-format.md.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
from dataclasses import dataclass

import numpy as np

from ..errors import DataError, UserError
from .tokens import FORMAT_NAME, FORMAT_VERSION

VOCAB_SIZE = 256
DEFAULT_VAL_PERCENT = 2.0
STDLIB_GLOB = "*.py"
SKIP_DIRS = ("__pycache__",)
STDLIB_SKIP_DIRS = ("site-packages", "dist-packages")  # third-party code: differs per machine
SPLIT_RULE = ("a document is in /val iff int.from_bytes(sha256(relative path, UTF-8).digest()[:8], 'big') "
              "% 10000 < val_percent * 100, else in /train")
SMOOTHING = ("add-one (Laplace) over 256 symbols: p(b | a) = (count(a, b) + 1) / (count(a) + 256) for "
             "bigram_bpb, p(b) = (count(b) + 1) / (n + 256) for unigram_bpb; counts from /train, "
             "scored on /val[1:]")
PAIR_CHUNK = 1 << 22  # bytes per bincount pass: bounds the int64 pair codes to 32 MiB


@dataclass
class Document:
    """One file of the corpus: ``relpath`` names it (and decides its split), ``path`` reads it."""

    relpath: str
    path: str


def stdlib_root() -> str:
    """The running Python's standard library directory (the default corpus)."""
    import sysconfig

    return sysconfig.get_paths()["stdlib"]


def collect_documents(paths, glob: str | None = None, exclude: str = "") -> tuple[list[Document], str, str]:
    """(documents, source description, glob used) for the PATHS of ``data text``.

    No paths: every ``*.py`` (or ``glob``) under the standard library, without
    site-packages. A file path is always included, named by its base name; a
    directory is walked recursively (symlinked directories are not followed,
    __pycache__ is skipped) for regular files matching ``glob`` (default ``*``),
    named by their path relative to it. The glob matches the base name, or the
    relative path when it contains '/'. Documents are sorted by (PATH index,
    relative path). ``exclude`` (the output file) is never read.
    """
    if not paths:
        import platform

        glob = glob or STDLIB_GLOB
        docs = _walk(stdlib_root(), glob, SKIP_DIRS + STDLIB_SKIP_DIRS, exclude)
        return docs, f"Python {platform.python_version()} standard library ({glob})", glob
    glob = glob or "*"
    docs = []
    for path in paths:
        if os.path.isdir(path):
            docs += _walk(path, glob, SKIP_DIRS, exclude)
        elif os.path.isfile(path):
            docs.append(Document(os.path.basename(os.path.normpath(path)), path))
        elif os.path.exists(path):
            raise DataError(f"data text: {path!r} is neither a regular file nor a directory; give text files "
                            f"or directories of them")
        else:
            raise DataError(f"data text: {path!r} does not exist; give existing files or directories "
                            f"(or none, for the Python standard library)")
    return docs, " ".join(paths), glob


def _walk(root: str, glob: str, skip: tuple[str, ...], exclude: str) -> list[Document]:
    """Regular files under ``root`` matching ``glob``, sorted by relative path ('/'-separated);
    a :class:`DataError` if none of them has a byte."""
    exclude = os.path.realpath(exclude) if exclude else ""
    by_path = "/" in glob
    docs = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if (fnmatch.fnmatchcase(rel if by_path else name, glob) and os.path.isfile(path)
                    and os.path.realpath(path) != exclude):
                docs.append(Document(rel, path))
    if not any(os.path.getsize(d.path) for d in docs):  # a typo in --glob would otherwise go unnoticed
        raise DataError(f"data text: directory {root!r} has no non-empty file matching --glob {glob!r}; "
                        f"check the directory and the pattern (it matches file names, or relative paths "
                        f"when it contains '/')")
    docs.sort(key=lambda d: d.relpath)
    return docs


def is_val(relpath: str, val_percent: float) -> bool:
    """The split rule: the document named ``relpath`` goes to /val (else /train)."""
    # surrogateescape: a file name that is not UTF-8 still hashes (to its raw bytes)
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8", "surrogateescape")).digest()[:8], "big")
    return h % 10000 < val_percent * 100


def bigram_bpb(train: np.ndarray, val: np.ndarray) -> float:
    """Bits per byte on ``val`` of the add-one-smoothed bigram model counted on ``train``:
    -mean log2 p(val[i+1] | val[i]) over i (summed per pair kind: order-free, one bincount)."""
    counts = _pair_counts(train).reshape(VOCAB_SIZE, VOCAB_SIZE).astype(np.float64)
    logp = np.log2(counts + 1.0) - np.log2(counts.sum(axis=1, keepdims=True) + VOCAB_SIZE)
    return float(-(_pair_counts(val) * logp.reshape(-1)).sum() / (len(val) - 1))


def unigram_bpb(train: np.ndarray, val: np.ndarray) -> float:
    """Bits per byte on ``val[1:]`` (the bytes bigram_bpb predicts) of the add-one-smoothed
    unigram model counted on ``train``."""
    counts = np.bincount(train, minlength=VOCAB_SIZE).astype(np.float64)
    logp = np.log2(counts + 1.0) - np.log2(len(train) + VOCAB_SIZE)
    scored = np.bincount(val[1:], minlength=VOCAB_SIZE)
    return float(-(scored * logp).sum() / (len(val) - 1))


def _pair_counts(stream: np.ndarray) -> np.ndarray:
    """How often each pair (a, b) follows in ``stream``, at index a * 256 + b."""
    counts = np.zeros(VOCAB_SIZE * VOCAB_SIZE, dtype=np.int64)
    for start in range(0, len(stream) - 1, PAIR_CHUNK):
        stop = min(start + PAIR_CHUNK, len(stream) - 1)
        codes = stream[start:stop].astype(np.int64) * VOCAB_SIZE + stream[start + 1:stop + 1]
        counts += np.bincount(codes, minlength=VOCAB_SIZE * VOCAB_SIZE)
    return counts


def write_token_file(out: str, paths=(), glob: str | None = None,
                     val_percent: float = DEFAULT_VAL_PERCENT) -> dict:
    """Build the token file ``out`` from ``paths`` (see :func:`collect_documents`); return its attributes.

    Reads every file once; written to a temporary name and renamed, so a crash
    never leaves a partial file. Raises :class:`DataError` for a missing path,
    a directory with no non-empty matching file, or a split left with fewer
    than 2 bytes (the baselines score pairs).
    """
    if not 0 <= val_percent <= 100:
        raise UserError(f"data text: --val-percent {val_percent} must be in [0, 100] (default 2)")
    docs, source, glob = collect_documents(paths, glob, exclude=out)
    texts = [_read(d.path) for d in docs]
    in_val = [is_val(d.relpath, val_percent) for d in docs]
    splits = {}
    for split, want in (("train", False), ("val", True)):
        chosen = [(d.relpath, t) for d, t, v in zip(docs, texts, in_val) if v == want]
        stream = np.frombuffer(b"".join(t for _, t in chosen), dtype=np.uint8)
        if len(stream) < 2:
            fix = "add files or raise --val-percent" if want else "add files or lower --val-percent"
            raise DataError(f"data text: the split leaves /{split} with {len(chosen)} documents and "
                            f"{len(stream)} bytes (val_percent={val_percent:g}, {len(docs)} documents in all); "
                            f"{fix}")
        offsets = np.zeros(len(chosen) + 1, dtype=np.int64)
        np.cumsum([len(t) for _, t in chosen], out=offsets[1:])
        splits[split] = (stream, offsets, [name for name, _ in chosen])
    train, val = splits["train"][0], splits["val"][0]
    attrs = {"format": FORMAT_NAME, "format_version": np.int64(FORMAT_VERSION),
             "vocab_size": np.int64(VOCAB_SIZE), "tokenizer": "bytes", "source": source, "glob": glob,
             "n_docs_train": np.int64(len(splits["train"][2])), "n_docs_val": np.int64(len(splits["val"][2])),
             "bytes_train": np.int64(len(train)), "bytes_val": np.int64(len(val)), "split_rule": SPLIT_RULE,
             "val_percent": np.float64(val_percent), "bigram_bpb": np.float64(bigram_bpb(train, val)),
             "unigram_bpb": np.float64(unigram_bpb(train, val)), "bigram_smoothing": SMOOTHING}
    _write(out, splits, attrs)
    return attrs


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise DataError(f"data text: cannot read {path!r} ({exc.strerror}); fix its permissions or leave it "
                        f"out") from None


def _write(out: str, splits: dict, attrs: dict) -> None:
    """Write ``out`` atomically and reproducibly: no timestamps, fixed order of datasets and attributes."""
    import h5py

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as f:
            for split, (stream, offsets, names) in splits.items():
                # contiguous, unfiltered: readers memory-map the streams (tokens.open_tokens)
                f.create_dataset(split, data=stream, track_times=False)
                f.create_dataset(f"{split}_doc_offsets", data=offsets, track_times=False)
                # names that are not UTF-8 (surrogate escapes) are stored with backslash escapes
                utf8 = [n.encode("utf-8", "backslashreplace").decode("utf-8") for n in names]
                f.create_dataset(f"{split}_docs", data=np.array(utf8, dtype=object),
                                 dtype=h5py.string_dtype("utf-8"), track_times=False)
            for key, value in attrs.items():
                f.attrs[key] = value
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise

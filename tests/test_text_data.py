"""Token files (data text), their reader, windows and batches, and data import (serial, no MPI)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpctrain.data import (DistributedSampler, TokenBatchReader, TokenWindows, eval_indices, open_dataset,
                           open_tokens, shard_range)
from hpctrain.data import importer
from hpctrain.data.importer import import_arrays
from hpctrain.data.text import write_token_file
from hpctrain.errors import DataError

from conftest import REPO

VAL_PERCENT = 25.0  # a few dozen documents: 2 % would leave /val empty


def make_corpus(root, reverse=False):
    """40 small files in nested folders (bytes of every value), one empty file, a __pycache__
    folder and a README; returns {relative path: bytes} of what `data text` must read."""
    rng = np.random.default_rng(7)
    files = {f"pkg{k % 4}/sub{k % 3}/mod{k:02d}.py": rng.integers(0, 256, int(rng.integers(50, 400)),
                                                                   dtype=np.uint8).tobytes() for k in range(40)}
    files["pkg0/empty.py"] = b""
    files["README"] = "naïve text\n".encode()
    for rel in sorted(files, reverse=reverse):  # creation order must not matter
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(files[rel])
    os.makedirs(os.path.join(root, "pkg1", "__pycache__"))
    with open(os.path.join(root, "pkg1", "__pycache__", "mod01.cpython-311.pyc"), "wb") as f:
        f.write(b"\x00compiled")
    return files


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(corpus files, path of its token file)."""
    d = tmp_path_factory.mktemp("corpus")
    files = make_corpus(str(d / "src"))
    out = str(d / "text.h5")
    write_token_file(out, [str(d / "src")], val_percent=VAL_PERCENT)
    return files, out


def read_split(path, split):
    with h5py.File(path, "r") as f:
        docs = [n.decode() for n in f[f"{split}_docs"][...]]
        return f[split][...], f[f"{split}_doc_offsets"][...], docs, dict(f.attrs)


def expected_val(rel, percent=VAL_PERCENT):
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % 10000 < percent * 100


# ---- data text -----------------------------------------------------------------------
def test_same_inputs_give_the_same_bytes_whatever_the_creation_order(tmp_path):
    outs = []
    for k, reverse in enumerate((False, True)):
        src = tmp_path / "src"
        shutil.rmtree(src, ignore_errors=True)
        make_corpus(str(src), reverse=reverse)
        outs.append(tmp_path / f"t{k}.h5")
        write_token_file(str(outs[-1]), [str(src)], val_percent=VAL_PERCENT)
        # the output inside the corpus is never read back in, so rebuilding there is stable too
        write_token_file(str(src / "in.h5"), [str(src)], val_percent=VAL_PERCENT)
        write_token_file(str(src / "in.h5"), [str(src)], val_percent=VAL_PERCENT)
        assert (src / "in.h5").read_bytes() == outs[0].read_bytes()
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_every_document_in_exactly_one_split_by_its_path_hash(built):
    files, path = built
    _, _, train_docs, attrs = read_split(path, "train")
    _, _, val_docs, _ = read_split(path, "val")
    assert not set(train_docs) & set(val_docs)
    assert sorted(train_docs + val_docs) == sorted(files)  # __pycache__ left out, empty file kept
    assert all(expected_val(d) for d in val_docs) and not any(expected_val(d) for d in train_docs)
    assert len(val_docs) >= 3 and len(train_docs) >= 20
    assert (attrs["n_docs_train"], attrs["n_docs_val"]) == (len(train_docs), len(val_docs))


@pytest.mark.parametrize("split", ["train", "val"])
def test_streams_are_the_documents_bytes_in_sorted_order(built, split):
    files, path = built
    stream, offsets, docs, attrs = read_split(path, split)
    assert docs == sorted(docs)
    assert stream.dtype == np.uint8 and stream.tobytes() == b"".join(files[d] for d in docs)
    assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == len(stream) == attrs[f"bytes_{split}"]
    np.testing.assert_array_equal(np.diff(offsets), [len(files[d]) for d in docs])
    for d, a, b in zip(docs, offsets[:-1], offsets[1:]):
        assert stream[a:b].tobytes() == files[d]
    with h5py.File(path, "r") as f:  # memory-mappable and reproducible
        assert f[split].chunks is None and f[split].compression is None


def test_attributes_and_baselines_match_an_independent_computation(built):
    _, path = built
    train, _, _, attrs = read_split(path, "train")
    val = read_split(path, "val")[0]
    assert attrs["format"] == "hpctrain-tokens" and attrs["format_version"] == 1
    assert attrs["vocab_size"] == 256 and attrs["tokenizer"] == "bytes" and attrs["glob"] == "*"
    assert attrs["val_percent"] == VAL_PERCENT and "sha256" in attrs["split_rule"]
    assert "add-one" in attrs["bigram_smoothing"]
    pairs = np.zeros((256, 256))
    np.add.at(pairs, (train[:-1], train[1:]), 1)
    p = (pairs + 1) / (pairs.sum(axis=1, keepdims=True) + 256)
    bigram = -np.mean([np.log2(p[a, b]) for a, b in zip(val[:-1], val[1:])])
    single = (np.bincount(train, minlength=256) + 1) / (len(train) + 256)
    unigram = -np.mean(np.log2(single[val[1:]]))
    assert attrs["bigram_bpb"] == pytest.approx(bigram, rel=1e-12)
    assert attrs["unigram_bpb"] == pytest.approx(unigram, rel=1e-12)


def test_glob_selects_by_name_and_given_files_are_always_in(tmp_path):
    files = make_corpus(str(tmp_path / "src"))
    out = str(tmp_path / "t.h5")
    write_token_file(out, [str(tmp_path / "src" / "pkg1"), str(tmp_path / "src" / "README")],
                     glob="mod0*.py", val_percent=50)
    docs = read_split(out, "train")[2] + read_split(out, "val")[2]
    want = {rel[len("pkg1/"):] for rel in files if rel.startswith("pkg1/") and "/mod0" in rel}
    assert set(docs) == want | {"README"}


@pytest.mark.parametrize("layout, needles", [
    ({"a/empty.txt": b""}, ["has no non-empty file", "'*'"]),
    ({"a/x.txt": b"text"}, ["has no non-empty file", "'*.py'"]),
])
def test_a_directory_without_text_names_it_and_the_glob(tmp_path, layout, needles):
    for rel, data in layout.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    glob = "*.py" if "'*.py'" in needles else None
    with pytest.raises(DataError) as info:
        write_token_file(str(tmp_path / "t.h5"), [str(tmp_path / "a")], glob=glob)
    assert all(n in str(info.value) for n in needles + [str(tmp_path / "a")]), info.value


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(DataError, match="nowhere.*does not exist"):
        write_token_file(str(tmp_path / "t.h5"), [str(tmp_path / "nowhere")])


@pytest.mark.parametrize("percent, split, fix", [(0, "/val", "raise --val-percent"),
                                                 (100, "/train", "lower --val-percent")])
def test_an_empty_split_says_to_change_the_percentage(tmp_path, percent, split, fix):
    make_corpus(str(tmp_path / "src"))
    with pytest.raises(DataError) as info:
        write_token_file(str(tmp_path / "t.h5"), [str(tmp_path / "src")], val_percent=percent)
    assert split in str(info.value) and fix in str(info.value) and "add files" in str(info.value)
    assert not os.path.exists(tmp_path / "t.h5")


def hpctrain(*args):
    """``python -m hpctrain ARGS`` as a user runs it: (exit code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_text_info_and_import(tmp_path):
    make_corpus(str(tmp_path / "src"))
    out = str(tmp_path / "t.h5")
    rc, line, _ = hpctrain("data", "text", "--out", out, str(tmp_path / "src"), "--val-percent", "25")
    assert rc == 0 and out in line and "bigram" in line and "unigram" in line and "docs" in line
    rc, info, _ = hpctrain("data", "info", out)
    assert rc == 0 and "token file, vocab 256" in info and "bigram" in info
    np.savez(tmp_path / "d.npz", x=np.ones((6, 2)), y=np.arange(6) % 3)
    rc, line, _ = hpctrain("data", "import", "--npz", str(tmp_path / "d.npz"), "--out", str(tmp_path / "c.h5"))
    assert rc == 0 and "6 x 2 float32, 3 classes" in line
    rc, _, err = hpctrain("data", "text", "--out", out, str(tmp_path / "absent"))
    assert rc == 2 and "hpctrain: error: data text:" in err and "Traceback" not in err


def test_the_standard_library_corpus(tmp_path):
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    attrs = write_token_file(a)
    write_token_file(b)
    assert open(a, "rb").read() == open(b, "rb").read()
    assert attrs["bytes_train"] > 1 << 20 and attrs["bytes_val"] > 0
    assert attrs["source"].startswith("Python ") and attrs["glob"] == "*.py"
    assert attrs["bigram_bpb"] < attrs["unigram_bpb"] < 8
    docs = read_split(a, "train")[2] + read_split(a, "val")[2]
    assert not [d for d in docs if "site-packages" in d or "__pycache__" in d]
    assert all(expected_val(d, 2.0) for d in read_split(a, "val")[2])


# ---- open_tokens ---------------------------------------------------------------------
def token_file(path, train, val, vocab=2**16, chunks=None, fmt="hpctrain-tokens"):
    with h5py.File(path, "w") as f:
        f.create_dataset("train", data=train, chunks=chunks)
        f.create_dataset("val", data=val)
        f.attrs["format"], f.attrs["vocab_size"] = fmt, vocab
    return str(path)


def expect_error(fn, *needles):
    with pytest.raises(DataError) as info:
        fn()
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_open_tokens_maps_the_written_streams(built):
    _, path = built
    data = open_tokens(path)
    try:
        assert isinstance(data.train, np.memmap) and isinstance(data.val, np.memmap)
        assert data.vocab_size == 256 and data.attrs["format"] == "hpctrain-tokens"
        np.testing.assert_array_equal(data.train, read_split(path, "train")[0])
    finally:
        data.close()


def test_token_and_tabular_files_name_each_other(tmp_path, built):
    _, tokens = built
    expect_error(lambda: open_dataset(tokens), "token file", 'model.kind = "gpt"')
    tabular = str(tmp_path / "c.h5")
    with h5py.File(tabular, "w") as f:
        f["x"], f["y"] = np.zeros((4, 2), np.float32), np.arange(4)
        f.attrs["n_classes"] = 4
    expect_error(lambda: open_tokens(tabular, "data.eval"), "data.eval", "tabular", 'model.kind = "mlp"',
                 "data text")


def test_open_tokens_errors(tmp_path):
    expect_error(lambda: open_tokens(str(tmp_path / "no.h5")), "not found", "data text --out")
    (tmp_path / "plain.h5").write_text("hello")
    expect_error(lambda: open_tokens(str(tmp_path / "plain.h5")), "not a readable HDF5 file")
    ok = np.arange(10, dtype=np.uint16)
    expect_error(lambda: open_tokens(token_file(tmp_path / "f.h5", ok, ok, fmt="other")), "not a token file")
    expect_error(lambda: open_tokens(token_file(tmp_path / "v.h5", ok, ok, vocab=1)), "vocab_size=1")
    expect_error(lambda: open_tokens(token_file(tmp_path / "r.h5", ok, ok, vocab=8)), "token 9 at position 9",
                 "/train")
    signed = -ok.astype(np.int16)
    expect_error(lambda: open_tokens(token_file(tmp_path / "n.h5", ok, signed, vocab=16)), "token -9", "/val")
    expect_error(lambda: open_tokens(token_file(tmp_path / "d.h5", ok.astype("f4"), ok)), "/train", "integer")


# ---- windows and batches -------------------------------------------------------------
T, L = 8, 8 * 67 + 5  # 67 windows (the last ends at token 536; 4 tokens of tail)


@pytest.fixture(params=["memmap", "h5py"])
def stream(request, tmp_path):
    """A /train of tokens 0..L-1 stored contiguous (memory-mapped) or chunked (read through h5py)."""
    chunks = (50,) if request.param == "h5py" else None
    data = open_tokens(token_file(tmp_path / "w.h5", np.arange(L, dtype=np.uint16), np.arange(9), chunks=chunks))
    assert isinstance(data.train, np.memmap) == (request.param == "memmap")
    yield data.train
    data.close()


def test_windows_are_shifted_pairs_in_the_order_asked(stream):
    w = TokenWindows(stream, T)
    assert w.n == (L - 1) // T == 67
    idx = np.array([66, 0, 5, 5, 31])
    x, y = w.read(idx)
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (5, T)
    assert x.flags.c_contiguous and y.flags.c_contiguous
    np.testing.assert_array_equal(x, idx[:, None] * T + np.arange(T))
    np.testing.assert_array_equal(y, x + 1)
    assert y[0, -1] == 67 * T  # the last window's last target
    with pytest.raises(IndexError):
        w.read([67])


def test_a_stream_shorter_than_a_window_says_what_to_change(stream):
    expect_error(lambda: TokenWindows(stream[:T], T, "data.eval", split="val"), "data.eval", "val stream has 8",
                 "context + 1 = 9", "model.context")
    assert TokenWindows(stream[:T + 1], T).n == 1


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_each_window_once_per_epoch_across_ranks(stream, size):
    G = 12
    windows = TokenWindows(stream, T)  # 67 windows: 5 steps of 12, 7 dropped per epoch
    readers = [TokenBatchReader(windows, DistributedSampler(windows.n, G, r, size, seed=3)) for r in range(size)]
    one = TokenBatchReader(windows, DistributedSampler(windows.n, G, 0, 1, seed=3))
    for epoch in range(2):
        seen = []
        for step in range(epoch * 5, epoch * 5 + 5):
            xs = [r.batch(step)[0] for r in readers]
            assert all(len(x) == G // size for x in xs)
            np.testing.assert_array_equal(np.concatenate(xs), one.batch(step)[0])
            seen += [int(v) // T for x in xs for v in x[:, 0]]
        assert len(seen) == len(set(seen)) == windows.n - windows.n % G


def test_a_fresh_reader_resumes_mid_epoch(stream):
    windows = TokenWindows(stream, T)
    walked = TokenBatchReader(windows, DistributedSampler(windows.n, 8, 1, 2, seed=5))
    batches = {s: walked.batch(s) for s in range(20)}
    for s in (13, 2, 19):
        x, y = TokenBatchReader(windows, DistributedSampler(windows.n, 8, 1, 2, seed=5)).batch(s)
        np.testing.assert_array_equal(x, batches[s][0])
        np.testing.assert_array_equal(y, batches[s][1])


@pytest.mark.parametrize("n, m", [(10, 0), (10, 10), (10, 20), (10, 3), (1000, 7), (7, 6), (1, 1), (0, 5)])
def test_eval_indices_spread_evenly_and_shard(n, m):
    idx = eval_indices(n, m)
    assert len(idx) == (n if m == 0 else min(n, m))
    assert np.all(np.diff(idx) > 0) and (not len(idx) or (idx[0] >= 0 and idx[-1] < n))
    if 0 < m < n:
        gaps = np.diff(idx)
        assert gaps.max() - gaps.min() <= 1 and idx[0] <= n // m  # even spacing from the start
    np.testing.assert_array_equal(idx, eval_indices(n, m))
    for size in (1, 3):
        shards = [idx[slice(*shard_range(len(idx), r, size))] for r in range(size)]
        np.testing.assert_array_equal(np.concatenate(shards), idx)


# ---- data import ---------------------------------------------------------------------
def test_import_npy_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((5000, 3, 2)), rng.integers(0, 4, 5000).astype(np.float64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    xm, ym, source = importer.load_arrays(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"))
    assert isinstance(xm, np.memmap)
    attrs = import_arrays(str(tmp_path / "c.h5"), xm, ym, classes=6, source=source)
    ds = open_dataset(str(tmp_path / "c.h5"))
    try:
        assert (ds.n, ds.dim, ds.n_classes, attrs["format"]) == (5000, 6, 6, "hpctrain-classification")
        np.testing.assert_array_equal(ds.x[...], x.reshape(5000, 6).astype(np.float32))
        np.testing.assert_array_equal(ds.y[...], y.astype(np.int64))
        assert ds.x.chunks == (4096, 6) and ds.y.dtype == np.int64
        np.testing.assert_array_equal(ds.file.attrs["class_counts"], np.bincount(y.astype(int), minlength=6))
    finally:
        ds.close()


def test_import_npz_round_trip(tmp_path):
    x, y = np.arange(20, dtype=np.int32).reshape(10, 2), np.arange(10) % 2
    np.savez(tmp_path / "d.npz", x=x, y=y)
    xl, yl, source = importer.load_arrays(npz=str(tmp_path / "d.npz"))
    import_arrays(str(tmp_path / "c.h5"), xl, yl, source=source)
    ds = open_dataset(str(tmp_path / "c.h5"))
    try:
        np.testing.assert_array_equal(ds.x[...], x)
        assert ds.n_classes == 2 and ds.file.attrs["n_features"] == 2
    finally:
        ds.close()


@pytest.mark.parametrize("x, y, classes, needles", [
    (np.zeros(10), np.zeros(10), 0, ["shape (10,)", "reshape(-1, 1)"]),
    (np.array([["a", "b"]] * 4), np.arange(4), 0, ["dtype <U1", "encode"]),
    (np.zeros((4, 2)), np.array([0, 1.5, 1, 0]), 0, ["y[1] = ", "whole number"]),
    (np.zeros((4, 2)), np.arange(3), 0, ["4 rows", "3 labels"]),
    (np.zeros((4, 2)), np.arange(4), 2, ["--classes 2", "label 3", "--classes 4"]),
    (np.zeros((4, 2)), np.array([0, -1, 1, 0]), 0, ["label -1", "0-based"]),
    (np.zeros((4, 2)), np.zeros(4), 0, ["1 classes", "--classes"]),
    (np.array([[0, 1], [2, np.nan]]), np.arange(2), 0, ["NaN or Inf in row 1"]),
])
def test_import_refuses_what_it_cannot_hold(tmp_path, x, y, classes, needles):
    out = str(tmp_path / "c.h5")
    expect_error(lambda: import_arrays(out, x, y, classes), "data import", *needles)
    assert os.listdir(tmp_path) == []  # nothing written, no temporary file left


def test_import_removes_the_temporary_file_when_the_reader_check_fails(tmp_path, monkeypatch):
    def refuse(path, what):
        raise DataError(f"{what}: {path} refused")

    monkeypatch.setattr(importer, "open_dataset", refuse)
    out = str(tmp_path / "c.h5")
    expect_error(lambda: import_arrays(out, np.zeros((3, 2)), np.arange(3)), f"{out} refused")
    assert os.listdir(tmp_path) == []


def test_import_file_errors(tmp_path):
    expect_error(lambda: importer.load_arrays(str(tmp_path / "x.npy"), str(tmp_path / "y.npy")), "not found")
    np.savez(tmp_path / "d.npz", a=np.zeros(3))
    expect_error(lambda: importer.load_arrays(npz=str(tmp_path / "d.npz")), "not x and y", "x=x, y=y")
    np.save(tmp_path / "o.npy", np.array([{}, 1], dtype=object))
    expect_error(lambda: importer.load_arrays(str(tmp_path / "o.npy"), str(tmp_path / "o.npy")), "pickled")

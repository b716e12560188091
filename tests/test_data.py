"""Synthetic data, HDF5 checks, the distributed sampler and row reading (serial, no MPI)."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest

from hpctrain.data import (DistributedSampler, open_dataset, per_rank_batch, read_rows,
                           shard_range)
from hpctrain.errors import DataError, LaunchError, UserError
from hpctrain.data.synth import MARGIN, Teacher, write_synthetic

DIM, C = 8, 4


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """Two identical writes of a train set and an eval set with the same teacher."""
    d = tmp_path_factory.mktemp("synth")
    paths = {name: str(d / f"{name}.h5") for name in ("a", "b", "eval", "other_teacher")}
    attrs = write_synthetic(paths["a"], 3000, DIM, C, seed=5, teacher_seed=11)
    write_synthetic(paths["b"], 3000, DIM, C, seed=5, teacher_seed=11)
    write_synthetic(paths["eval"], 1000, DIM, C, seed=6, teacher_seed=11)
    write_synthetic(paths["other_teacher"], 1000, DIM, C, seed=6, teacher_seed=12)
    return paths, attrs


def load(path):
    with h5py.File(path, "r") as f:
        return f["x"][...], f["y"][...], dict(f.attrs)


# ---- synthetic data ----------------------------------------------------------------
def test_write_synthetic_is_bit_identical_for_the_same_arguments(synth):
    paths, _ = synth
    xa, ya, attrs_a = load(paths["a"])
    xb, yb, attrs_b = load(paths["b"])
    assert xa.dtype == np.float32 and ya.dtype == np.int64
    assert xa.shape == (3000, DIM) and ya.shape == (3000,)
    assert xa.tobytes() == xb.tobytes() and ya.tobytes() == yb.tobytes()
    assert attrs_a.keys() == attrs_b.keys()
    # a different seed gives different samples
    xe, _, _ = load(paths["eval"])
    assert not np.array_equal(xa[:1000], xe)


def test_synthetic_labels_in_range_and_roughly_balanced(synth):
    paths, attrs = synth
    _, y, file_attrs = load(paths["a"])
    assert y.min() >= 0 and y.max() < C
    counts = np.bincount(y, minlength=C)
    assert counts.max() < 2 * len(y) / C      # no class takes twice its share
    assert counts.min() > 0
    np.testing.assert_array_equal(file_attrs["class_counts"], counts)
    assert int(file_attrs["n_classes"]) == C and attrs["n_classes"] == C


def test_train_and_eval_with_the_same_teacher_share_the_labelling(synth):
    paths, _ = synth
    teacher = Teacher(DIM, C, teacher_seed=11)
    for name in ("a", "eval"):
        x, y, _ = load(paths[name])
        np.testing.assert_array_equal(teacher.labels(x), y)
        # ambiguous samples were redrawn: every label is at least MARGIN from a tie
        assert teacher.margins(x).min() >= MARGIN
    # another teacher labels the same inputs differently (so the check above can fail)
    x, y, _ = load(paths["other_teacher"])
    assert np.mean(teacher.labels(x) != y) > 0.2


# ---- open_dataset errors -----------------------------------------------------------
def h5(tmp_path, name="d.h5", x=None, y=None, n_classes=C):
    path = str(tmp_path / name)
    with h5py.File(path, "w") as f:
        if x is not None:
            f["x"] = x
        if y is not None:
            f["y"] = y
        if n_classes is not None:
            f.attrs["n_classes"] = n_classes
    return path


X = np.zeros((10, 3), dtype=np.float32)
Y = np.zeros(10, dtype=np.int64)


def expect_data_error(path, *needles):
    with pytest.raises(DataError) as info:
        open_dataset(path)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_open_dataset_valid_file(tmp_path):
    ds = open_dataset(h5(tmp_path, x=X, y=Y))
    try:
        assert (ds.n, ds.dim, ds.n_classes) == (10, 3, C)
    finally:
        ds.close()


def test_open_dataset_missing_file(tmp_path):
    path = str(tmp_path / "missing.h5")
    expect_data_error(path, path, "not found")


def test_open_dataset_empty_path():
    expect_data_error("", "data.train", "empty")


def test_open_dataset_not_hdf5(tmp_path):
    path = tmp_path / "text.h5"
    path.write_text("x,y\n1,2\n")
    expect_data_error(str(path), "not a readable HDF5 file")


def test_open_dataset_missing_y(tmp_path):
    expect_data_error(h5(tmp_path, x=X), "lacks", "/y")


def test_open_dataset_missing_x_and_y(tmp_path):
    expect_data_error(h5(tmp_path), "/x", "/y")


def test_open_dataset_1d_x(tmp_path):
    expect_data_error(h5(tmp_path, x=np.zeros(10, np.float32), y=Y), "/x", "2-D")


def test_open_dataset_integer_x(tmp_path):
    expect_data_error(h5(tmp_path, x=np.zeros((10, 3), np.int32), y=Y), "/x", "float")


def test_open_dataset_float_y(tmp_path):
    expect_data_error(h5(tmp_path, x=X, y=np.zeros(10, np.float32)), "/y", "integer")


def test_open_dataset_length_mismatch(tmp_path):
    expect_data_error(h5(tmp_path, x=X, y=np.zeros(9, np.int64)), "10 rows", "/y has 9")


def test_open_dataset_missing_n_classes(tmp_path):
    expect_data_error(h5(tmp_path, x=X, y=Y, n_classes=None), "n_classes")


def test_open_dataset_too_few_classes(tmp_path):
    expect_data_error(h5(tmp_path, x=X, y=Y, n_classes=1), "n_classes=1")


def test_data_errors_are_user_errors():
    assert issubclass(DataError, UserError) and issubclass(LaunchError, UserError)


# ---- DistributedSampler ------------------------------------------------------------
def samplers(n, global_batch, size, seed=0):
    return [DistributedSampler(n, global_batch, rank, size, seed) for rank in range(size)]


def epoch_indices(ss, epoch):
    """All ranks' indices over one epoch, concatenated."""
    spe = ss[0].steps_per_epoch
    return np.concatenate([s.indices(step) for step in range(epoch * spe, (epoch + 1) * spe) for s in ss])


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_sample_once_per_epoch_when_divisible(size):
    G = 12                     # divisible by 1, 2, 3, 4
    n = 5 * G
    ss = samplers(n, G, size)
    assert ss[0].steps_per_epoch == 5 and ss[0].batch == G // size
    for epoch in (0, 1):
        seen = epoch_indices(ss, epoch)
        assert len(seen) == n
        np.testing.assert_array_equal(np.sort(seen), np.arange(n))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_with_a_remainder_each_sample_at_most_once(size):
    G = 12
    n = 5 * G + 7              # 7 samples dropped per epoch
    ss = samplers(n, G, size)
    assert ss[0].steps_per_epoch == 5
    for epoch in (0, 1, 2):
        seen = epoch_indices(ss, epoch)
        assert len(seen) == 5 * G
        assert len(np.unique(seen)) == len(seen)
        assert seen.min() >= 0 and seen.max() < n


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ranks_at_a_step_concatenate_to_the_global_batch_slice(size):
    G, n, seed = 12, 40, 9      # 3 steps per epoch, 4 dropped
    ss = samplers(n, G, size, seed=seed)
    for step in range(7):       # crosses two epoch boundaries
        epoch, s = divmod(step, 3)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        got = np.concatenate([r.indices(step) for r in ss])
        np.testing.assert_array_equal(got, perm[s * G:(s + 1) * G])
        assert all(len(r.indices(step)) == G // size for r in ss)


def test_different_epochs_use_different_permutations():
    s = DistributedSampler(64, 16, 0, 1, seed=3)
    e0, e1 = epoch_indices([s], 0), epoch_indices([s], 1)
    assert sorted(e0) == sorted(e1) == list(range(64))
    assert not np.array_equal(e0, e1)


def test_same_seed_same_indices_different_seed_differs():
    a = DistributedSampler(100, 10, 1, 2, seed=42)
    b = DistributedSampler(100, 10, 1, 2, seed=42)
    c = DistributedSampler(100, 10, 1, 2, seed=43)
    steps = range(25)
    ia = np.concatenate([a.indices(k) for k in steps])
    np.testing.assert_array_equal(ia, np.concatenate([b.indices(k) for k in steps]))
    assert not np.array_equal(ia, np.concatenate([c.indices(k) for k in steps]))


def test_indices_are_a_pure_function_of_the_step():
    # resuming at step k (fresh sampler), or visiting epochs out of order, gives the same rows
    walked = DistributedSampler(50, 10, 1, 2, seed=1)
    seq = {k: walked.indices(k).copy() for k in range(12)}
    for k in (11, 0, 7, 3, 10, 5):
        np.testing.assert_array_equal(DistributedSampler(50, 10, 1, 2, seed=1).indices(k), seq[k])
        np.testing.assert_array_equal(walked.indices(k), seq[k])


def test_position_splits_global_step_into_epoch_and_step():
    s = DistributedSampler(50, 10, 0, 1, seed=0)   # 5 steps per epoch
    assert [s.position(k) for k in (0, 4, 5, 12)] == [(0, 0), (0, 4), (1, 0), (2, 2)]


def test_dataset_smaller_than_a_global_batch_raises_data_error():
    with pytest.raises(DataError, match=r"10 samples.*global batch \(16\)"):
        DistributedSampler(10, 16, 0, 1, seed=0)
    DistributedSampler(16, 16, 0, 1, seed=0)  # exactly one batch is fine


# ---- per_rank_batch ----------------------------------------------------------------
@pytest.mark.parametrize("G, size, expected", [(256, 1, 256), (256, 4, 64), (12, 3, 4), (3, 3, 1)])
def test_per_rank_batch_divides(G, size, expected):
    assert per_rank_batch(G, size) == expected


@pytest.mark.parametrize("G, size", [(10, 3), (10, 4), (2, 4), (255, 2)])
def test_per_rank_batch_not_divisible_suggests_a_fix(G, size):
    with pytest.raises(LaunchError) as info:
        per_rank_batch(G, size)
    msg = str(info.value)
    assert f"global_batch={G}" in msg and f"world size {size}" in msg
    # the fix is a ready --set; the suggested batch sizes really are multiples of the world size
    m = re.search(r"--set train\.global_batch=(\d+)(?: or (\d+))?", msg)
    assert m, msg
    suggested = [int(v) for v in m.groups() if v]
    assert all(b > 0 and b % size == 0 for b in suggested), msg


def test_sampler_with_exact_shares_rejects_a_world_size_that_does_not_divide_the_batch():
    with pytest.raises(LaunchError):
        DistributedSampler(100, 10, 0, 3, seed=0, exact=True)


@pytest.mark.parametrize("G, size", [(10, 3), (10, 4), (55, 2), (7, 7)])
def test_uneven_shares_differ_by_one_row_and_cover_each_global_batch_once(G, size):
    samplers = [DistributedSampler(100, G, rank, size, seed=3) for rank in range(size)]
    assert [s.batch for s in samplers] == [G // size + (r < G % size) for r in range(size)]
    assert all(s.even == (G % size == 0) for s in samplers)
    for step in (0, 1, 100 // G + 1):   # an epoch boundary too
        whole = DistributedSampler(100, G, 0, 1, seed=3).indices(step)
        np.testing.assert_array_equal(np.concatenate([s.indices(step) for s in samplers]), whole)


def test_a_global_batch_smaller_than_the_world_size_is_an_error():
    with pytest.raises(LaunchError, match="smaller than the world size 4"):
        DistributedSampler(100, 3, 0, 4, seed=0)


# ---- read_rows ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    r = np.random.default_rng(0)
    x = r.standard_normal((57, 5)).astype(np.float32)
    y = r.integers(0, 3, size=57).astype(np.int64)
    path = str(tmp_path_factory.mktemp("rows") / "rows.h5")
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y
        f.attrs["n_classes"] = 3
    ds = open_dataset(path)
    yield ds, x, y
    ds.close()


@pytest.mark.parametrize("rows", [
    [40, 3, 17, 0, 56, 8],          # unsorted
    [56, 55, 54, 1, 0],              # descending
    [5],                             # one row
    list(range(57))[::-1],           # every row, reversed
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_read_rows_returns_rows_in_requested_order(rows_file, rows, dtype):
    ds, x, y = rows_file
    rows = np.array(rows, dtype=np.int64)
    xr, yr = read_rows(ds, rows, dtype)
    assert xr.dtype == dtype and yr.dtype == np.int64
    assert xr.shape == (len(rows), 5) and yr.shape == (len(rows),)
    np.testing.assert_array_equal(xr, x[rows].astype(dtype))
    np.testing.assert_array_equal(yr, y[rows])


def test_read_rows_of_a_sampler_step(rows_file):
    ds, x, y = rows_file
    s = DistributedSampler(ds.n, 8, 1, 2, seed=4)
    for step in range(9):
        idx = s.indices(step)
        xr, yr = read_rows(ds, idx, np.float64)
        np.testing.assert_array_equal(xr, x[idx])
        np.testing.assert_array_equal(yr, y[idx])


# ---- shard_range -------------------------------------------------------------------
@pytest.mark.parametrize("n, size", [(10, 3), (7, 4), (3, 4), (12, 4), (1, 1), (0, 2), (1001, 7)])
def test_shard_range_covers_disjointly_and_evenly(n, size):
    ranges = [shard_range(n, r, size) for r in range(size)]
    # contiguous and in rank order: each starts where the previous stopped
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(size - 1))
    lengths = [stop - start for start, stop in ranges]
    assert min(lengths) >= 0 and max(lengths) - min(lengths) <= 1
    covered = np.concatenate([np.arange(a, b) for a, b in ranges])
    np.testing.assert_array_equal(covered, np.arange(n))

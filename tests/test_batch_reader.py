"""Batch reading: both read paths and the read-ahead window return exactly the sampler's rows."""

import h5py
import numpy as np
import pytest

from hpctrain.data import tabular
from hpctrain.data import BatchReader, DistributedSampler, open_dataset, read_rows


@pytest.fixture
def chunked(tmp_path):
    """1000 rows in chunks of 64 (the last chunk partial); x[i] = [i, -i, 2i], y[i] = i % 7."""
    path = tmp_path / "c.h5"
    n = 1000
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.stack([np.arange(n), -np.arange(n), 2 * np.arange(n)], 1).astype("f4"),
                         chunks=(64, 3))
        f.create_dataset("y", data=np.arange(n) % 7, chunks=(64,))
        f.attrs["n_classes"] = 7
    ds = open_dataset(str(path))
    yield ds
    ds.close()


@pytest.mark.parametrize("amplification", [0, 8, 10**6])  # 0: always point reads; 10**6: always slabs
def test_read_rows_both_paths_keep_the_requested_order(chunked, monkeypatch, amplification):
    monkeypatch.setattr(tabular, "MAX_READ_AMPLIFICATION", amplification)
    rng = np.random.default_rng(0)
    for k in (1, 5, 100, 999):
        rows = rng.permutation(1000)[:k]  # unsorted, spanning partial last chunk
        x, y = read_rows(chunked, rows, np.float64)
        assert x.dtype == np.float64
        np.testing.assert_array_equal(x[:, 0], rows)
        np.testing.assert_array_equal(x[:, 1], -rows)
        np.testing.assert_array_equal(y, rows % 7)


@pytest.mark.parametrize("window_rows", [1, 48, 100, 10**6])
def test_read_ahead_window_matches_the_sampler_across_epochs(chunked, window_rows):
    sampler = DistributedSampler(1000, 48, rank=1, size=3, seed=5)  # 20 steps/epoch, 16 rows per rank
    reader = BatchReader(chunked, sampler, np.float32, window_rows=window_rows)
    for step in list(range(45)) + [7, 3, 44]:  # three epochs, then going back
        x, y = reader.batch(step)
        rows = sampler.indices(step)
        np.testing.assert_array_equal(x[:, 0], rows)
        np.testing.assert_array_equal(y, rows % 7)

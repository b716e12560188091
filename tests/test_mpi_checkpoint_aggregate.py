"""Aggregated checkpoint writes (``checkpoint.writers_per_node``, hpctrain/ckpt/aggregate.py), under
mpirun -n 1..4: the file equals the one every rank writes itself, dataset by dataset and byte for byte;
it verifies and resumes bit-exact; a rank failing during the writes, writer or not, gives every rank
one agreed error without a hang (the test's timeout is the hang detector) and commits nothing.
"""

import os

import h5py
import numpy as np
import pytest

from test_mpi_checkpoint import _config, _fresh_dir, _state_bytes, _steps, _trainer

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import init_world

    return init_world()


def _nodes(world, ranks_per_node):
    """The job's world, or the same ranks as emulated nodes of ``ranks_per_node`` ranks each."""
    from hpctrain.runtime import init_world

    return world if not ranks_per_node else init_world(world.comm, ranks_per_node=ranks_per_node)


def _entries(world):
    """Row counts that split unevenly (and leave ranks without rows of the bias at 4 ranks), a 3-D
    float64, an int64 vector and a per-rank row whose values name the rank; closed-form values."""
    from hpctrain.ckpt.state import Entry

    big = (np.arange(37 * 5, dtype=np.float32) * 0.5).reshape(37, 5)
    cube = np.arange(9 * 2 * 3, dtype=np.float64).reshape(9, 2, 3) - 20.25
    bias, counts = np.array([1.5, -2.0, 3.25], np.float32), np.arange(7, dtype=np.int64) * 10**12
    mine = np.array([world.rank, 10 * world.rank + 1], np.uint64)
    arrays = {"/model/a/weight": big, "/model/a/bias": bias, "/model/b/weight": cube, "/data/counts": counts}
    entries = [Entry(p, a.shape, a.dtype, lambda lo, hi, a=a: a[lo:hi]) for p, a in arrays.items()]
    entries.append(Entry("/rng/pcg64", (None, 2), mine.dtype, lambda lo, hi: mine[None], per_rank=True))
    return arrays, mine, entries


def _datasets(path) -> dict:
    """Every dataset's bytes, dtype, shape and attributes (the root attributes differ: ``created``)."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, (obj[...].tobytes(), obj.dtype.str, obj.shape,
                                                                dict(obj.attrs)))
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _same_files(world, plain, aggregated):
    from hpctrain.ckpt.read import verify_file

    if world.rank == 0:
        verify_file(aggregated)
        a, b = _datasets(plain), _datasets(aggregated)
        assert a.keys() == b.keys() and len(a) > 0
        for name in a:
            assert a[name] == b[name], name
    world.comm.Barrier()


@pytest.mark.parametrize("ranks_per_node", [0, 2])
@pytest.mark.parametrize("collective", [False, True])
@pytest.mark.parametrize("writers", [1, 2])
def test_aggregated_file_equals_plain(world, monkeypatch, ranks_per_node, collective, writers):
    """writers_per_node 1 and 2, on the real node and on emulated nodes of 2 ranks, independent and
    collective transfers, slices in pieces of 2 rows (own rows) and of 1 row (sent to a writer)."""
    from hpctrain.ckpt import aggregate, slices
    from hpctrain.ckpt.read import load_checkpoint
    from hpctrain.ckpt.write import write_checkpoint

    monkeypatch.setattr(slices, "PIECE_BYTES", 40)     # 2 rows of the (37, 5) float32 array
    monkeypatch.setattr(aggregate, "SEND_BYTES", 20)   # 1 row per message to a writer
    w = _nodes(world, ranks_per_node)
    arrays, mine, entries = _entries(w)
    d = _fresh_dir(world, f"agg-{ranks_per_node}-{collective}-{writers}")
    plain = write_checkpoint(d + "/plain", 1, entries, {"epoch": 0}, w, collective=collective, writers_per_node=0)
    agg = write_checkpoint(d + "/agg", 1, entries, {"epoch": 0}, w, collective=collective, writers_per_node=writers)
    _same_files(world, plain, agg)
    loaded = load_checkpoint(agg, w)
    for path, a in arrays.items():
        np.testing.assert_array_equal(loaded.full[path], a)
    np.testing.assert_array_equal(loaded.own_rows["/rng/pcg64"], mine)


def test_writer_map():
    """Blocks of consecutive local ranks, the lowest of each writing; nodes of unequal size."""
    from types import SimpleNamespace

    from hpctrain.ckpt.aggregate import writer_map

    def writers(nodes, per_node):  # nodes: the node of each rank, ranks in local order per node
        where = [(n, sum(1 for m in nodes[:r] if m == n)) for r, n in enumerate(nodes)]
        comm = SimpleNamespace(allgather=lambda _: where)
        return writer_map(SimpleNamespace(comm=comm, node_rank=nodes[0], local_rank=0), per_node)[0]

    assert writers([0, 0, 0, 0], 1) == [0, 0, 0, 0]
    assert writers([0, 0, 0, 0], 2) == [0, 0, 2, 2]
    assert writers([0, 0, 0, 0], 0) == writers([0, 0, 0, 0], 4) == writers([0, 0, 0, 0], 9) == [0, 1, 2, 3]
    assert writers([0, 0, 0, 1, 1], 2) == [0, 0, 2, 3, 4]
    assert writers([0, 0, 0, 1, 1], 1) == [0, 0, 0, 3, 3]
    assert writers([0, 0, 0, 0, 0], 3) == [0, 0, 2, 2, 4]


@pytest.mark.parametrize("ranks_per_node", [0, 2])
def test_aggregated_training_save_resumes_bit_exact(world, mpi_small_data, ranks_per_node):
    """A trainer's save with writers_per_node = 1 holds the same datasets as with 0, and a run resumed
    from it ends with the bytes of an uninterrupted run."""
    n_steps, k = 12, 5
    w = _nodes(world, ranks_per_node)
    d = _fresh_dir(world, f"agg-train-{ranks_per_node}")
    straight = _trainer(_config(mpi_small_data[0], d + "-unused", w.size, n_steps), w)
    straight.run()
    first = _trainer(_config(mpi_small_data[0], d + "/plain", w.size, n_steps), w)
    _steps(first, k)
    first.checkpoints.c.writers_per_node = 0
    plain = first.checkpoints.save(first.state)
    first.checkpoints.c.writers_per_node, first.checkpoints.directory = 1, d + "/agg"
    agg = first.checkpoints.save(first.state)
    _same_files(world, plain, agg)
    resumed = _trainer(_config(mpi_small_data[0], d + "/agg", w.size, n_steps, resume=agg), w)
    assert resumed.step == k
    resumed.run()
    assert _state_bytes(resumed) == _state_bytes(straight)


def _failing_rank(world, role):
    """The rank to fail with writers_per_node = 1 on the job's one node: the writer (rank 0) or the
    last rank (a member whose rows go to rank 0; at 1 rank the writer)."""
    return 0 if role == "writer" else world.size - 1


@pytest.mark.parametrize("collective", [False, True])
@pytest.mark.parametrize("where", ["rows", "hdf5"])
@pytest.mark.parametrize("role", ["writer", "member"])
def test_failure_during_aggregated_write(world, monkeypatch, role, where, collective):
    """One rank fails while the data is written: its rows cannot be produced ("rows", on any rank),
    or the writer's HDF5 write of a member's rows fails ("hdf5"): one agreed error, no hang."""
    from hpctrain.ckpt import slices, write
    from hpctrain.ckpt.format import row_range
    from hpctrain.ckpt.state import Entry

    if where == "hdf5" and (role == "member" or world.size == 1):
        pytest.skip("members make no HDF5 data writes, and a writer without members writes only its own rows")
    monkeypatch.setattr(slices, "PIECE_BYTES", 40)
    bad = _failing_rank(world, role)
    arrays, mine, entries = _entries(world)
    if where == "rows":  # the existing hook: an Entry whose rows raise (a device copy that failed)
        weight = arrays["/model/a/weight"]

        def rows(lo, hi):
            if world.rank == bad:
                raise OSError(5, "Input/output error")
            return weight[lo:hi]
        entries[0] = Entry("/model/a/weight", weight.shape, weight.dtype, rows)
    else:  # the writer's transfer of a member's piece (rows of another rank) reports a failure
        real, own = slices.write_rows, row_range(37, world.rank, world.size)

        def write_rows(dset, lo, hi, block, coll):
            real(dset, lo, hi, block, coll)  # collective: the call is made, then it fails (as a full disk)
            if world.rank == bad and hi > lo and dset.shape == (37, 5) and not own[0] <= lo < own[1]:
                raise OSError(28, "No space left on device")
        monkeypatch.setattr(slices, "write_rows", write_rows)
    d = _fresh_dir(world, f"agg-fail-{role}-{where}-{collective}")
    with pytest.raises(write.CheckpointWriteError) as err:
        write.write_checkpoint(d, 2, entries, {"epoch": 0}, world, collective=collective, writers_per_node=1)
    text = str(err.value)
    assert ("Input/output error" if where == "rows" else "No space left") in text, text
    assert text.count("rank ") <= 1 and (f"rank {bad}:" in text) == (world.size > 1), text
    world.comm.Barrier()
    assert not [n for n in os.listdir(d) if n.startswith("ckpt-")]  # nothing committed

"""Reading checkpoints in child processes (hpctrain/ckpt/isolated.py, decode.py, share.py) and the root
attributes' CRC: the training process never opens a checkpoint with HDF5, the child's heap is
capped, a damaged root attribute is refused, and version-1 files (before that CRC) still load."""

import json
import resource
import subprocess
import sys
import types

import h5py
import numpy as np
import pytest

from conftest import REPO
from hpctrain.ckpt import decode, isolated, read, share
from hpctrain.ckpt.format import attrs_crc32
from hpctrain.ckpt.read import CorruptCheckpoint, load_checkpoint, verify_file
from steps import train_step

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def saved(small_data, tmp_path_factory):
    """A 1-rank training checkpoint (adamw, so /optim has two states) and the arrays it holds."""
    from test_checkpoint_state import _config, _trainer

    folder = tmp_path_factory.mktemp("isolation")
    t = _trainer(_config(small_data[0], str(folder)))
    for _ in range(3):
        train_step(t)
    path = t.checkpoints.save(t.state)
    with h5py.File(path, "r") as f:
        arrays = {}
        f.visititems(lambda n, o: arrays.update({"/" + n: o[()]}) if isinstance(o, h5py.Dataset) else None)
    return path, arrays


def _world():
    from mpi4py import MPI

    return types.SimpleNamespace(comm=MPI.COMM_SELF, rank=0, size=1)


def _copy(path, tmp_path, name="ckpt-00000003.h5"):
    out = tmp_path / name
    out.write_bytes(open(path, "rb").read())
    return str(out)


def test_load_never_opens_the_file_with_hdf5_in_this_process(saved, monkeypatch):
    path, arrays = saved
    import h5py as real

    def refuse(*args, **kwargs):
        raise AssertionError("h5py.File called in the training process")

    monkeypatch.setattr(real, "File", refuse)  # the child imports its own h5py
    loaded = load_checkpoint(path, _world())
    assert loaded.step == 3 and loaded.attrs["attrs_crc32"] == attrs_crc32(loaded.attrs)
    for name, a in arrays.items():
        got = loaded.own_rows[name] if name.startswith(("/rng", "/compress")) else loaded.full[name]
        want = a[0] if name.startswith(("/rng", "/compress")) else a
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert got.flags.writeable or name in loaded.full  # own rows are private copies


def test_in_process_share_equals_the_childs(saved):
    path, _ = saved
    a_attrs, a_meta, a_blocks, a_own = share.read_share(path, 0, 1, isolate=True)
    b_attrs, b_meta, b_blocks, b_own = share.read_share(path, 0, 1, isolate=False)
    assert a_attrs == b_attrs and a_meta == b_meta
    for x, y in ((a_blocks, b_blocks), (a_own, b_own)):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("rank,size", [(0, 3), (1, 3), (2, 3), (4, 5)])
def test_shares_tile_every_dataset(saved, rank, size):
    path, arrays = saved
    _, meta, blocks, own = share.read_share(path, rank, size)
    assert [m[0] for m in meta] == sorted(arrays)
    for name, shape, dtype, _, per_rank in meta:
        lo = rank * (shape[0] // size) + min(rank, shape[0] % size)
        np.testing.assert_array_equal(blocks[name], arrays[name][lo:lo + len(blocks[name])])
        assert (name in own) == (per_rank and rank < shape[0])


@pytest.mark.parametrize("attr,value", [("config", "[train]\nsteps = 7\n"), ("epoch", 5), ("created", "yesterday")])
def test_a_changed_root_attribute_fails_its_crc(saved, tmp_path, attr, value):
    path = _copy(saved[0], tmp_path)
    with h5py.File(path, "r+") as f:
        if attr == "config":  # keep the TOML valid and consistent with the other attributes
            value = f.attrs["config"].replace("steps = 6", "steps = 7")
            assert value != f.attrs["config"]
        f.attrs[attr] = value
    for check in (verify_file, lambda p: load_checkpoint(p, _world())):
        with pytest.raises(CorruptCheckpoint, match="root attributes fail their checksum"):
            check(path)


def test_version_1_files_without_the_attributes_crc_still_load(saved, tmp_path):
    path = _copy(saved[0], tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 1
        del f.attrs["attrs_crc32"]
    assert verify_file(path)["format_version"] == 1
    assert load_checkpoint(path, _world()).step == 3
    with h5py.File(path, "r+") as f:  # a version-2 file must have it
        f.attrs["format_version"] = 2
    with pytest.raises(CorruptCheckpoint, match="root attributes fail their checksum"):
        verify_file(path)


def test_the_childs_heap_is_capped_near_the_files_size(saved):
    path, _ = saved
    code = ("import sys, numpy as np; from hpctrain.ckpt.isolated import _cap_heap; _cap_heap(sys.argv[1]); "
            "a = np.ones(3 << 30, np.uint8)")
    proc = subprocess.run([sys.executable, "-c", code, path], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "MemoryError" in proc.stderr, proc.stderr
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    assert soft == resource.RLIM_INFINITY or soft > 3 << 30  # the test process itself is not capped


def test_running_out_of_memory_in_the_child_is_a_corrupt_file(saved, monkeypatch, capsys):
    monkeypatch.setattr(isolated, "_cap_heap", lambda path: None)  # main() runs in this process here
    def exhausted(path):
        raise MemoryError()

    monkeypatch.setitem(decode.CHILD_OPS, "verify_file", exhausted)
    assert isolated.main("verify_file", saved[0]) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["error"] == "corrupt" and "more memory than the file's size allows" in answer["text"]


@pytest.mark.parametrize("behaviour,message", [("kill -SEGV $$", r"HDF5 crashed \(SIGSEGV\)"),
                                               ("sleep 60", "did not finish in 2 s")])
def test_a_crashing_or_stuck_child_is_one_corrupt_error(saved, monkeypatch, tmp_path, behaviour, message):
    """The child's interpreter replaced by a script that crashes or hangs, whatever it is asked."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{behaviour}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setattr(isolated, "TIMEOUT_S", 2)
    monkeypatch.setattr(isolated, "SLOW_READ_BYTES_PER_S", 1e30)
    for reader in (verify_file, read.header_of, read.inspect_file, lambda p: load_checkpoint(p, _world())):
        with pytest.raises(CorruptCheckpoint, match=message):
            reader(saved[0])

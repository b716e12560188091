"""Checkpoint pieces in one process: CRC combination, row split, RNG encoding, the
write paths (independent, collective, serial fallback) and a CUDA -> CPU resume.

The CUDA device here is numba's simulator (tests/conftest.py), so this runs in CI.
"""

import io
import os
import zlib

import numpy as np
import pytest

from hpctrain.ckpt.format import combine_parts, crc32_combine, crc32_of, list_checkpoints, row_range
from hpctrain.ckpt.state import fresh_rng, rng_from_array, rng_to_array
from hpctrain.training.config import Config
from hpctrain.device import cuda_status
from hpctrain.errors import UserError
from steps import train_step

pytestmark = pytest.mark.timeout(300)


def test_crc32_combine_equals_zlib_of_the_concatenation():
    rng = np.random.default_rng(0)
    for la, lb in [(0, 0), (0, 7), (7, 0), (1, 1), (1000, 3), (4097, 65536)]:
        a, b = rng.bytes(la), rng.bytes(lb)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)
    parts = [rng.bytes(n) for n in (5, 0, 300, 1, 0, 77)]
    assert combine_parts([(zlib.crc32(p), len(p)) for p in parts]) == zlib.crc32(b"".join(parts))


def test_crc32_of_is_the_c_order_little_endian_bytes():
    a = np.arange(12, dtype=">f4").reshape(3, 4)
    assert crc32_of(a) == zlib.crc32(a.astype("<f4").tobytes())
    assert crc32_of(a.T) == zlib.crc32(np.ascontiguousarray(a.T).astype("<f4").tobytes())


@pytest.mark.parametrize("rows", [0, 1, 3, 10, 1001])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_row_ranges_tile_the_rows_in_rank_order(rows, size):
    ranges = [row_range(rows, r, size) for r in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1


def test_rng_state_round_trip_continues_the_same_stream():
    gen = fresh_rng(3, 1, 5)
    gen.normal(size=7)  # has_uint32 / uinteger change with some draws
    gen.integers(0, 2**31, size=3, dtype=np.uint32)
    copy = rng_from_array(rng_to_array(gen))
    np.testing.assert_array_equal(copy.random(100), gen.random(100))
    assert rng_to_array(copy).dtype == np.uint64


def test_list_checkpoints_ignores_temporaries_and_other_names(tmp_path):
    for name in ("ckpt-00000002.h5", "ckpt-00000010.h5", ".ckpt-00000012.h5.tmp", "ckpt-3.h5", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [10, 2]
    assert list_checkpoints(str(tmp_path / "missing")) == []


# ---- whole saves in a 1-rank world --------------------------------------------------------
def _config(train, ckpt_dir, device="cpu", resume="", collective=False):
    cfg = Config()
    cfg.data.train, cfg.data.eval = train, ""
    cfg.model.hidden, cfg.model.activation = [16, 12], "gelu"
    cfg.train.global_batch, cfg.train.dtype, cfg.train.device = 12, "float64", device
    cfg.train.steps, cfg.train.log_every, cfg.train.metrics = 6, 10**6, ""
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps = "adamw", 0.01, 0
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.collective_io = ckpt_dir, resume, collective
    return cfg.validate()


def _trainer(cfg, out=None):
    from mpi4py import MPI

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    return Trainer(cfg, init_world(MPI.COMM_SELF), Log(out is not None, out))


def _host_state(t):
    dev = t.device
    return {"params": dev.to_host(t.model.flat.data), "t": t.optimizer.t,
            **{k: dev.to_host(v) for k, v in t.optimizer.state().items()}}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("mode", ["independent", "collective", "serial-fallback"])
def test_save_paths_round_trip(small_data, tmp_path, monkeypatch, mode):
    from hpctrain.ckpt import write
    from hpctrain.ckpt.read import verify_file

    out = io.StringIO()
    if mode == "serial-fallback":
        monkeypatch.setattr(write, "mpi_hdf5", lambda: False)
    t = _trainer(_config(small_data[0], str(tmp_path), collective=mode == "collective"), out)
    for _ in range(3):
        train_step(t)
    path = t.checkpoints.save(t.state)
    assert verify_file(path)["step"] == 3
    assert ("lacks MPI support" in out.getvalue()) == (mode == "serial-fallback")
    back = _trainer(_config(small_data[0], str(tmp_path), resume=path))
    assert back.step == 3
    _assert_same(_host_state(back), _host_state(t))


@pytest.mark.skipif(cuda_status()[0] == 0, reason="numba.cuda unusable")
def test_cuda_checkpoint_resumes_on_cpu_and_continues_alike(small_data, tmp_path):
    """Saved from device arrays (simulated GPU), loaded into a CPU run: the same bytes,
    and both continue to the same parameters (float64 twins agree to rounding)."""
    gpu = _trainer(_config(small_data[0], str(tmp_path), device="cuda"))
    for _ in range(2):
        train_step(gpu)
    path = gpu.checkpoints.save(gpu.state)
    cpu = _trainer(_config(small_data[0], str(tmp_path), device="cpu", resume=path))
    _assert_same(_host_state(cpu), _host_state(gpu))
    gpu_again = _trainer(_config(small_data[0], str(tmp_path), device="cuda", resume=path))
    _assert_same(_host_state(gpu_again), _host_state(gpu))  # and back onto the device
    for t in (gpu, cpu):
        train_step(t)
    np.testing.assert_allclose(_host_state(cpu)["params"], _host_state(gpu)["params"], rtol=1e-10, atol=1e-13)


def test_checkpoint_of_another_model_lists_the_mismatches(small_data, tmp_path):
    from hpctrain.errors import UserError

    t = _trainer(_config(small_data[0], str(tmp_path)))
    path = t.checkpoints.save(t.state)
    cfg = _config(small_data[0], str(tmp_path), resume=path)
    cfg.model.hidden = [16, 10]
    with pytest.raises(UserError) as err:
        _trainer(cfg)
    text = str(err.value)
    assert "/model/fc1/weight: checkpoint (16, 12), model (16, 10)" in text
    assert "/model/fc2/weight" in text and "/model/fc0/weight" not in text
    sgd = _config(small_data[0], str(tmp_path), resume=path)
    sgd.optim.name = "sgd"
    with pytest.raises(UserError, match="momentum"):
        _trainer(sgd)


def test_sgd_and_lars_refuse_each_others_momentum_and_lamb_takes_adamws_moments(small_data, tmp_path):
    """The same state names that mean different things (LARS's momentum holds the learning rate) are
    one clear error; AdamW's moments are LAMB's, and resume under it at the saved step."""
    cfg = _config(small_data[0], str(tmp_path / "sgd"))
    cfg.optim.name, cfg.checkpoint.save_final = "sgd", True
    _trainer(cfg).run()
    lars = _config(small_data[0], str(tmp_path / "sgd"), resume="auto")
    lars.optim.name = "lars"
    with pytest.raises(UserError, match=r"optim.name=sgd's \(sgd momentum\), not optim.name=lars's; resume with "
                                        r"--set optim.name=sgd"):
        _trainer(lars)
    cfg = _config(small_data[0], str(tmp_path / "adamw"))
    cfg.checkpoint.save_final = True
    _trainer(cfg).run()
    lamb = _config(small_data[0], str(tmp_path / "adamw"), resume="auto")
    lamb.optim.name, lamb.train.steps = "lamb", 8
    resumed = _trainer(lamb)
    assert resumed.step == 6 and resumed.optimizer.t == 6


def test_keep_last_deletes_the_oldest(small_data, tmp_path):
    cfg = _config(small_data[0], str(tmp_path))
    cfg.checkpoint.every_steps, cfg.checkpoint.keep_last = 1, 2
    _trainer(cfg).run()
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [6, 5]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_keep_last_never_deletes_this_runs_save_among_newer_files(small_data, tmp_path):
    """A fresh run in a directory holding another run's higher-numbered checkpoints keeps its own."""
    a = _config(small_data[0], str(tmp_path))
    a.train.steps, a.checkpoint.every_steps = 6, 2
    _trainer(a).run()                       # run A: 6, 4, 2
    b = _config(small_data[0], str(tmp_path))
    b.train.steps, b.checkpoint.every_steps, b.checkpoint.keep_last, b.train.seed = 3, 1, 2, 5
    _trainer(b).run()                       # run B saves 1, 2 (replacing A's 2), 3
    steps = [s for s, _ in list_checkpoints(str(tmp_path))]
    assert steps == [6, 4, 3, 2], steps     # A's newer files untouched; B keeps its newest 2 below...
    # ...and nothing of B newer than what it saved was deleted: its last save is there
    from hpctrain.ckpt.read import verify_file
    assert verify_file(str(tmp_path / "ckpt-00000003.h5"))["step"] == 3


def test_auto_resume_stops_when_every_checkpoint_is_corrupt(small_data, tmp_path):
    from hpctrain.errors import UserError

    cfg = _config(small_data[0], str(tmp_path))
    cfg.train.steps, cfg.checkpoint.every_steps = 4, 2
    _trainer(cfg).run()
    for _, path in list_checkpoints(str(tmp_path)):
        with open(path, "r+b") as fh:
            fh.truncate(100)
    with pytest.raises(UserError, match="none verifies"):
        _trainer(_config(small_data[0], str(tmp_path), resume="auto"))


def test_ckpt_cli_survives_malformed_files(tmp_path):
    import subprocess
    import sys

    import h5py

    from conftest import REPO

    bad = tmp_path / "ckpt-00000001.h5"
    with h5py.File(bad, "w") as f:  # hpctrain-looking header with wrong types
        f.attrs["format"], f.attrs["format_version"] = "hpctrain-checkpoint", 1
        f.attrs["complete"], f.attrs["step"], f.attrs["world_size"], f.attrs["config"] = [1, 1], 1, 1, 7
        f.create_dataset("model/x", shape=(1 << 40,), dtype="f8", chunks=(1 << 20,))  # huge, no storage
    (tmp_path / "ckpt-00000002.h5").symlink_to(tmp_path / "missing.h5")  # pruned while listing
    garbage = tmp_path / "ckpt-00000003.h5"
    garbage.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(200))
    for args in (["ls", str(tmp_path)], ["ls", str(tmp_path), "--verify"], ["verify", str(bad), str(garbage)],
                 ["inspect", str(bad)], ["inspect", str(garbage)]):
        proc = subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, (args, proc.stderr)
        assert proc.returncode in (0, 1), (args, proc.returncode, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", "verify", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "INVALID" in proc.stdout


def test_every_minutes_saves_on_rank_0s_clock(small_data, tmp_path):
    cfg = _config(small_data[0], str(tmp_path))
    cfg.checkpoint.every_minutes, cfg.checkpoint.keep_last = 1.0, 0  # due after 60 s
    t = _trainer(cfg)
    clock = iter(range(0, 10**6, 25))  # each reading of the manager's clock advances 25 s
    t.checkpoints.clock = lambda: float(next(clock))
    t.checkpoints._last_save = t.checkpoints.clock()  # 0 s
    t.run()
    steps = [s for s, _ in list_checkpoints(str(tmp_path))]
    # step k asks at 25 k s; a save resets the clock: due at 75 s (step 3), then 75 s after 100 (step 6)
    assert steps == [6, 3], steps

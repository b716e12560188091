"""Bad inputs of issue 9 as a user meets them: each ends with one message (printed once, by
rank 0) that names the problem and the fix, and a non-zero exit.

Wrong-dtype and wrong-shape datasets, out-of-range dist settings, a checkpoint of another model
or optimizer, and a disk that fills up during a save (a real, small tmpfs). A checkpoint that does
not fit and the full disk are real `mpirun -n 2` jobs, each launch with a timeout; the dataset and
dist-setting errors, set-up errors agreed by every rank, are checked in this process on the same
code (test_cli._one_error_in_process, whose docstring names the real launches of that mechanism).
(Missing files, 1-D /x, labels out of range and more are in test_cli.py.)
"""

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import REPO, run_mpi
from hpctrain.training.config_load import load_config
from test_cli import TRAIN, _data_set, _one_error, _one_error_in_process, _train_setup

pytestmark = pytest.mark.timeout(180)

N = 256
DATASETS = {  # name: (what to store, fragments of the one error line)
    "x-strings": (dict(x=np.full((N, 4), b"1.5")), ["/x must be a 2-D float array", "|S3", "x.astype('float32')"]),
    "x-complex": (dict(x=np.zeros((N, 4), np.complex64)), ["complex64", "x.astype('float32')"]),
    "x-bool": (dict(x=np.zeros((N, 4), bool)), ["/x must be a 2-D float array", "bool"]),
    "x-int8": (dict(x=np.zeros((N, 4), np.int8)), ["int8", "x.astype('float32')"]),
    "x-3d": (dict(x=np.zeros((N, 4, 2), np.float32)), ["shape (256, 4, 2)", "x.reshape(len(x), -1)"]),
    "x-no-features": (dict(x=np.zeros((N, 0), np.float32)), ["0 features per sample"]),
    "y-float": (dict(y=np.zeros(N, np.float32)), ["/y must be a 1-D integer array", "y.astype('int64')"]),
    "y-one-hot": (dict(y=np.eye(4, dtype=np.int64)[np.arange(N) % 4]), ["shape (256, 4)", "y.argmax(axis=1)"]),
    "rows": (dict(y=np.zeros(N - 1, np.int64)), ["/x has 256 rows but /y has 255"]),
    "n-classes-text": (dict(n_classes="four"), ["n_classes='four' must be an integer", "f.attrs['n_classes']"]),
}


@pytest.mark.parametrize("name", list(DATASETS))
def test_wrong_dtype_or_shape_dataset_is_one_clear_error(tmp_path, capsys, name):
    spec, fragments = DATASETS[name]
    path = tmp_path / f"{name}.h5"
    with h5py.File(path, "w") as f:
        f["x"] = spec.get("x", np.zeros((N, 4), np.float32))
        f["y"] = spec.get("y", np.arange(N) % 4)
        f.attrs["n_classes"] = spec.get("n_classes", 4)
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(str(path))), str(path), *fragments)


@pytest.mark.parametrize("override,fragments", [
    ("dist.bucket_mb=-1", ["dist.bucket_mb=-1.0", ">= 0", "0 = one bucket"]),
    ("dist.first_bucket_mb=0", ["dist.first_bucket_mb=0.0", "> 0"]),
    ("dist.allreduce=fastest", ["dist.allreduce='fastest'", "choose one of mpi, naive, ring"]),
    ("dist.compress=zip", ["dist.compress='zip'", "choose none, fp16"]),
])
def test_out_of_range_dist_setting_is_one_clear_error(small_data, capsys, override, fragments):
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(small_data[0]), "--set", override), *fragments)


def test_bucket_mb_0_is_valid_one_bucket_after_backward():
    assert load_config(None, ["dist.bucket_mb=0"]).dist.bucket_mb == 0.0  # documented meaning, not an error


def _ckpt_run_args(data, ckpt, *extra, steps=2):
    return TRAIN + _data_set(data) + ["--set", f"train.steps={steps}", "--set", f"checkpoint.dir={ckpt}",
                                      "--set", "train.log_every=1000", *extra]


def _ckpt_run(data, ckpt, *extra, steps=2):
    return run_mpi(2, _ckpt_run_args(data, ckpt, *extra, steps=steps))


def test_checkpoint_of_another_model_or_optimizer_is_one_clear_error(small_data, tmp_path, capsys):
    """Another model: the real launch of a checkpoint that cannot be loaded. Another optimizer: a
    1-rank resume of the same 2-rank checkpoint, in this process (test_cli._one_error_in_process;
    the check that refuses it runs before anything that depends on the world size)."""
    ck = str(tmp_path / "ck")
    saved = _ckpt_run(small_data[0], ck, "--set", "model.hidden=[32]", "--set", "checkpoint.save_final=true")
    assert saved.returncode == 0, saved.stderr
    wider = _ckpt_run(small_data[0], ck, "--set", "model.hidden=[64,64]", "--resume", "auto", steps=4)
    _one_error(wider, "does not fit this model", "--set model.hidden=[32]", "--resume ''")
    for line in ("/model/fc0/weight: checkpoint (8, 32), model (8, 64)", "/model/fc1/weight: checkpoint (32, 4), "
                 "model (64, 64)", "/model/fc2/weight: missing in the checkpoint (model has (64, 4))"):
        assert wider.stderr.count(line) == 1, wider.stderr  # the list of mismatches, printed once
    adamw = _train_setup(*_ckpt_run_args(small_data[0], ck, "--set", "model.hidden=[32]", "--set", "optim.name=adamw",
                                         "--resume", "auto", steps=4)[3:])
    _one_error_in_process(capsys, adamw, "no optimizer state 'exp_avg'", "--set optim.name=sgd")


MIB = 1 << 20
DISK = ["--set", "model.hidden=[256,256]", "--set", "optim.name=adamw", "--set", "checkpoint.every_steps=2",
        "--set", "checkpoint.keep_last=0"]  # ~0.8 MiB per checkpoint: two fit in 2 MiB, the third does not


@pytest.fixture(scope="module")
def full_disk(small_data, tmp_path_factory):
    """A 2 MiB tmpfs and a job saving every 2 steps into it: steps 2 and 4 fit, step 6 fills the disk."""
    mnt = tmp_path_factory.mktemp("tmpfs")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={2 * MIB}", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        print(f"cannot mount a tmpfs ({mounted.stderr.strip()}): the full-disk tests need root")
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        ck = mnt / "ck"
        yield ck, _ckpt_run(small_data[0], ck, *DISK, steps=10)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(small_data, full_disk):
    ck, proc = full_disk
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "hpctrain: error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in ("saving checkpoint step 6", "the disk is full", "MiB free", "previous checkpoints are intact",
                     "free space or choose another checkpoint.dir"):
        assert fragment in errors[0], errors[0]
    assert sorted(os.listdir(ck)) == ["ckpt-00000002.h5", "ckpt-00000004.h5"]  # no .tmp left behind
    verify = subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", "verify", str(ck / "ckpt-00000004.h5")],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and "OK (step 4" in verify.stdout, verify.stdout

    os.remove(ck / "ckpt-00000002.h5")  # free space, then the requeued job resumes and saves again
    done = _ckpt_run(small_data[0], ck, *DISK, "--resume", "auto", steps=6)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {ck}/ckpt-00000004.h5 at step 4" in done.stdout, done.stdout
    assert sorted(os.listdir(ck)) == ["ckpt-00000004.h5", "ckpt-00000006.h5"]


def test_full_disk_exits_2_without_a_crash_at_exit(full_disk):
    """HDF5 cannot close the half-written file (its metadata flush fails too); closing it again at
    MPI_Finalize crashed (SIGSEGV, exit 139) until the command line left such a process directly."""
    _, proc = full_disk
    assert "Fatal Python error" not in proc.stderr and proc.returncode == 2, (proc.returncode, proc.stderr[-800:])

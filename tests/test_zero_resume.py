"""A checkpoint saved under ZeRO-1 loads at another world size and another stage: saved at step 4
by 4 ranks with dist.zero = 1, resumed to step 8 by 2 ranks with zero 0 and by 3 ranks with zero 2;
both end where one rank with the whole batch ends, uninterrupted (float64, rtol 1e-10: the rank
counts add per-sample gradients in different orders). Real mpirun jobs, as a user runs them."""

import os
import shutil

import numpy as np
import pytest

from conftest import run_mpi

pytestmark = [pytest.mark.timeout(300)]


def _args(data, ckpt, steps, zero, resume=""):
    return ["-m", "hpctrain", "train", "--set", f"data.train={data}", "--set", "data.eval=", "--set",
            "model.hidden=[16,12]", "--set", "train.global_batch=24", "--set", f"train.steps={steps}",
            "--set", "train.dtype=float64", "--set", "train.log_every=1000000", "--set", "train.target_accuracy=0",
            "--set", "train.metrics=", "--set", "optim.name=adamw", "--set", "optim.lr=0.003",
            "--set", "dist.allreduce=ring", "--set", "dist.bucket_mb=0.001", "--set", "dist.first_bucket_mb=0.0003",
            "--set", f"dist.zero={zero}", "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_minutes=0",
            "--set", "checkpoint.keep_last=0", "--set", "checkpoint.save_final=true", "--resume", resume]


def _arrays(path):
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset)
                     and n.startswith(("model/", "optim/")) else None)
    return out


def test_a_zero_1_checkpoint_resumes_at_other_world_sizes_and_stages(small_data, tmp_path):
    ref, saved = tmp_path / "ref", tmp_path / "saved"
    for n, ckpt, steps, zero in ((1, ref, 8, 0), (4, saved, 4, 1)):
        done = run_mpi(n, _args(small_data[0], ckpt, steps, zero), timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
    want = _arrays(ref / "ckpt-00000008.h5")
    assert any(k.startswith("optim/exp_avg_sq/") for k in want)
    for n, zero in ((2, 0), (3, 2)):
        ckpt = tmp_path / f"resumed-{n}-z{zero}"
        ckpt.mkdir()
        shutil.copy(saved / "ckpt-00000004.h5", ckpt)
        done = run_mpi(n, _args(small_data[0], ckpt, 8, zero, resume="auto"), timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"resumed from {ckpt}/ckpt-00000004.h5 at step 4 (saved by 4 rank(s)" in done.stdout, done.stdout
        got = _arrays(os.path.join(ckpt, "ckpt-00000008.h5"))
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-13, err_msg=f"{k} ({n} ranks, zero {zero})")

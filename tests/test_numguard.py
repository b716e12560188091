"""The numerical guard: NaN/Inf and loss spikes under each policy (abort, skip, rollback).

Unit tests of the verdicts, then real 2-rank jobs with a NaN (or a spike) injected
into one rank's batch at a given step (HPCTRAIN_FAULT, hpctrain/reliability/faults.py): the
jobs that end with exit 0 run one after another in one launch (guard_jobs), each aborting one in
a launch of its own; the 1-rank runs run in this process."""

import json
import os
import subprocess
import sys
import types

import h5py
import numpy as np
import pytest

from conftest import REPO
from hpctrain.errors import EXIT_DIVERGED, TrainingDiverged
from hpctrain.reliability.numeric_guard import NumericGuard
from mpi_jobs import env
from test_cli import train_in_process

pytestmark = pytest.mark.timeout(240)
# the tests of guard_jobs: the first of them to run waits for the launch of all 12 jobs (~35 s in CI)
SHARED_LAUNCH = pytest.mark.timeout(480)


class _Log:
    def __init__(self):
        self.lines = []

    def warn(self, msg):
        self.lines.append(msg)


def _guard(policy="skip", z=0.0, window=4, max_bad=3):
    cfg = types.SimpleNamespace(nonfinite=policy, spike_zscore=z, spike_window=window, max_bad_steps=max_bad)
    return NumericGuard(cfg, _Log())


def test_verdicts():
    g = _guard(z=4.0)
    assert g.verdict(0, 1.0) is None
    assert "the loss on 1 rank(s)" in g.verdict(1, float("nan"), bad_loss_ranks=1)
    assert "the averaged gradient" in g.verdict(2, 0.9, bad_grad_ranks=2)
    assert "NaN/Inf in the loss" in g.verdict(3, float("inf"))
    for step, loss in enumerate((1.0, 1.1, 0.9), start=4):  # window of 4 accepted losses: 1.0 1.0 1.1 0.9
        assert g.verdict(step, loss) is None
    assert g.spike_z(1.0) == pytest.approx((1.0 - 1.0) / np.std([1.0, 1.0, 1.1, 0.9], ddof=1))
    assert g.verdict(7, 1.2) is None                       # z = 2.4: accepted, enters the window
    reason = g.verdict(8, 5.0)
    assert reason.startswith("loss spike at step 8") and "guard.spike_zscore=4" in reason
    assert list(g.losses) == [1.0, 1.1, 0.9, 1.2]          # a bad loss never enters the statistics


def test_flat_window_does_not_turn_rounding_into_spikes():
    g = _guard(z=3.0, window=3)
    for step in range(3):
        g.verdict(step, 0.5)
    assert g.verdict(3, 0.5 * (1 + 1e-9)) is None


def test_policies_and_the_bad_step_limit():
    with pytest.raises(TrainingDiverged) as err:
        _guard("abort").bad_step(5, "NaN")
    assert err.value.exit_code == EXIT_DIVERGED and err.value.agreed and "guard.nonfinite=abort" in str(err.value)
    g = _guard("rollback", max_bad=2)
    assert g.deferred and g.bad_step(5, "NaN") == "rollback" and g.skip_steps == {5}
    assert g.bad_step(9, "NaN") == "rollback"
    with pytest.raises(TrainingDiverged, match="more than guard.max_bad_steps=2"):
        g.bad_step(12, "NaN")
    assert not _guard("abort").deferred


# ---- real jobs ---------------------------------------------------------------------------
def _train_args(data, ckpt, *extra, steps=60):
    """The arguments of ``python -m hpctrain train`` for these jobs."""
    return ["--set", f"data.train={data}", "--set", "model.hidden=[64]",
            "--set", "train.global_batch=64", "--set", f"train.steps={steps}", "--set", "train.log_every=1000",
            "--set", f"train.metrics={ckpt}.jsonl", "--set", f"checkpoint.dir={ckpt}",
            "--set", "checkpoint.every_steps=10", "--set", "checkpoint.every_minutes=0", *extra]


def _run(data, ckpt, n, *extra, fault="nan:25:1", steps=60):
    """One launch of ``python -m hpctrain train``: the jobs whose exit code and stderr are the launch's."""
    args = ["-m", "hpctrain", "train", *_train_args(data, ckpt, *extra, steps=steps)]
    launch = ["mpirun", "-n", str(n), "--oversubscribe", sys.executable] if n > 1 else [sys.executable]
    return subprocess.run(launch + args, cwd=REPO, env=env(HPCTRAIN_FAULT=fault), capture_output=True,
                          text=True, timeout=180)


KEEP = ("--set", "checkpoint.keep_last=0")  # every save kept: the comparisons read steps 20, 30 and 60
COMPRESS = {
    "topk": ("--set", 'dist.compress="topk(0.1)"'),  # error feedback's residuals
    "powersgd+momentum": ("--set", 'dist.compress="powersgd(2)"', "--set", "dist.compress_momentum=true",
                          "--set", "optim.name=adamw", "--set", "optim.freeze_step=12",
                          "--set", "dist.compress_start_step=12"),  # residuals, Q and velocities
}
SKIP, ROLLBACK = ("--set", "guard.nonfinite=skip"), ("--set", "guard.nonfinite=rollback")
# name -> (HPCTRAIN_FAULT, train.steps, --set overrides) of the 2-rank jobs that end with exit 0 (guard_jobs)
JOBS = {
    "skip-25": ("nan:25:1", 60, (*SKIP, *KEEP)),
    "back-25": ("nan:25:1", 60, (*ROLLBACK, *KEEP)),
    "skip-19": ("nan:19:1", 60, (*SKIP, *KEEP)),
    "back-19": ("nan:19:1", 60, (*ROLLBACK, *KEEP)),
    "clean": ("", 60, ()),
    "first": ("nan:7:0", 12, (*ROLLBACK, "--set", "checkpoint.every_steps=0")),
    **{f"{how}-{name}": ("nan:25:1", 60, (*policy, *KEEP, *sets)) for name, sets in COMPRESS.items()
       for how, policy in (("skip", SKIP), ("back", ROLLBACK))},
    "ef": ("nan:25:1", 60, (*ROLLBACK, "--set", 'dist.compress="topk(0.1)"', "--set", "dist.compress_start_step=22",
                            "--set", "guard.max_bad_steps=2")),
    "spike": ("spike:40:1", 60, (*SKIP, "--set", "guard.spike_zscore=6", "--set", "guard.spike_window=10")),
}

# Each rank of one launch runs the jobs in turn through python -m hpctrain train's own main (its config,
# trainer, exit code), each with its HPCTRAIN_FAULT (read once, when the job's trainer is built) and
# its stdout and stderr in files of its own.
DRIVER = r"""
import json, os, sys
from hpctrain.__main__ import main
from hpctrain.runtime import launched_rank

jobs, folder, rank = json.loads(sys.argv[1]), sys.argv[2], launched_rank()
for name, fault, argv in jobs:
    os.environ["HPCTRAIN_FAULT"] = fault
    saved = os.dup(1), os.dup(2)
    with open(f"{folder}/{name}.{rank}.out", "w") as out, open(f"{folder}/{name}.{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = main(["train", *argv])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    with open(f"{folder}/{name}.{rank}.rc", "w") as fh:
        fh.write(str(code))
"""


@pytest.fixture(scope="module")
def guard_jobs(small_data, tmp_path_factory):
    """name -> (checkpoint dir, the job's returncode, stdout and stderr as a launch of its own gives
    them) for every job in JOBS. One launch of two ranks runs them all (DRIVER): a launch per job
    spent most of its time starting (MPI, imports, JIT), not training."""
    folder = tmp_path_factory.mktemp("guard-jobs")
    jobs = [(name, fault, _train_args(small_data[0], str(folder / name), *sets, steps=steps))
            for name, (fault, steps, sets) in JOBS.items()]
    launch = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-c", DRIVER, json.dumps(jobs),
                             str(folder)], cwd=REPO, env=env(), capture_output=True, text=True, timeout=420)

    def job(name):
        files = {(rank, kind): folder / f"{name}.{rank}.{kind}" for rank in (0, 1) for kind in ("rc", "out", "err")}
        text = {key: path.read_text() if path.exists() else "" for key, path in files.items()}
        codes = [int(text[rank, "rc"]) if text[rank, "rc"] else None for rank in (0, 1)]
        returncode = None if None in codes else next((c for c in codes if c), 0)  # mpirun's: the first failure
        stderr = text[0, "err"] + text[1, "err"] + ("" if returncode is not None else
                                                    f"\n(no exit code; the launch's stderr:)\n{launch.stderr}")
        return str(folder / name), subprocess.CompletedProcess(name, returncode, text[0, "out"] + text[1, "out"],
                                                               stderr)

    return {name: job(name) for name in JOBS}


def _metrics(ckpt):
    with open(f"{ckpt}.jsonl") as fh:
        return [json.loads(line) for line in fh]


def _params(path, group="model"):
    with h5py.File(path, "r") as f:
        out = {}
        f[group].visititems(lambda name, d: out.__setitem__(name, d[()]) if isinstance(d, h5py.Dataset) else None)
        return out


def test_abort_stops_before_saving_the_bad_step(small_data, tmp_path):
    ckpt = str(tmp_path / "abort")
    proc = _run(small_data[0], ckpt, 2)
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert len(errors) == 1 and "NaN/Inf in the averaged gradient at step 25" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000010.h5", "ckpt-00000020.h5"]
    assert all(np.isfinite(v).all() for v in _params(f"{ckpt}/ckpt-00000020.h5").values())


@SHARED_LAUNCH
@pytest.mark.parametrize("n", [1, 2])
def test_skip_drops_the_step_and_counts_it(small_data, tmp_path, request, monkeypatch, capsys, n):
    """n = 2: a real 2-rank job (guard_jobs' skip-25, whose keep_last=0 changes nothing read here: the
    last save is kept at every keep_last). n = 1: the run ``python -m hpctrain train`` makes without a
    launcher, on one rank in this process (test_cli.train_in_process; its result gives the command's
    exit code), the fault read from the environment as the job reads it."""
    if n == 2:
        ckpt, proc = request.getfixturevalue("guard_jobs")["skip-25"]
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout
    else:
        ckpt = str(tmp_path / "skip")
        monkeypatch.setenv("HPCTRAIN_FAULT", f"nan:25:{n - 1}")
        result = train_in_process(*_train_args(small_data[0], ckpt, "--set", "guard.nonfinite=skip"))
        assert result["stopped_by"] is None and result["targets_met"], result  # exit code 0
        out = capsys.readouterr().out
    assert "guard: NaN/Inf in the averaged gradient at step 25" in out and "skip (1 of at most" in out
    rows = _metrics(ckpt)
    assert [r["step"] for r in rows if r["skipped"]] == [26]  # the record of step 25 is written as step 26
    assert rows[-1]["step"] == 60 and rows[-1]["bad_steps"] == 1 and np.isfinite(rows[-1]["loss"])
    assert all(np.isfinite(v).all() for v in _params(f"{ckpt}/ckpt-00000060.h5").values())


@pytest.fixture(scope="module")
def clean_params(guard_jobs):
    """The parameters at step 60 of the 2-rank run without a fault (one run for both cases below)."""
    clean, proc = guard_jobs["clean"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _params(f"{clean}/ckpt-00000060.h5")


@SHARED_LAUNCH
@pytest.mark.parametrize("bad", [25, 19])
def test_rollback_equals_skip_bit_for_bit(guard_jobs, bad, clean_params):
    """Rollback reloads the last save and steps over the bad batch on the replay; skip drops that
    step's update in place. Both leave the state of a run that never saw the batch: the same bits.
    (Step 19: stepping over it reaches a save point, step 20, which must still be saved.)"""
    (skip, skipped), (back, proc) = guard_jobs[f"skip-{bad}"], guard_jobs[f"back-{bad}"]  # fault nan:{bad}:1
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = bad // 10 * 10
    assert f"guard: rolled back to {back}/ckpt-{last:08d}.h5 (step {last})" in proc.stdout, proc.stdout
    assert f"stepping over the batch of step {bad}" in proc.stdout
    for step in (20, 60):
        a, b = _params(f"{skip}/ckpt-{step:08d}.h5"), _params(f"{back}/ckpt-{step:08d}.h5")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), step
    # and the bad batch mattered: a run without the fault ends elsewhere
    a = _params(f"{skip}/ckpt-00000060.h5")
    assert any(not np.array_equal(a[k], clean_params[k]) for k in a)


@SHARED_LAUNCH
def test_rollback_without_a_checkpoint_saves_one_first(guard_jobs):
    ckpt, proc = guard_jobs["first"]  # checkpoint.every_steps=0, 12 steps, fault nan:7:0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"guard: rolled back to {ckpt}/ckpt-00000000.h5 (step 0)" in proc.stdout, proc.stdout


@SHARED_LAUNCH
@pytest.mark.parametrize("compress", list(COMPRESS))
def test_skip_with_compression_equals_rollback_bit_for_bit(guard_jobs, compress):
    """A skipped step puts the compressor's per-rank state (residuals, PowerSGD's Q, velocities) back as it
    was before the step, as a rollback does by reloading the last save: both runs end with the same
    parameters and the same compressor state, and so lose nothing the bad step did not bring."""
    (skip, proc), (back, rolled) = guard_jobs[f"skip-{compress}"], guard_jobs[f"back-{compress}"]  # nan:25:1
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "guard: NaN/Inf in the averaged gradient at step 25" in proc.stdout, proc.stdout[-3000:]
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    assert "stepping over the batch of step 25" in rolled.stdout, rolled.stdout[-3000:]
    for step in (30, 60):
        a, b = _params(f"{skip}/ckpt-{step:08d}.h5"), _params(f"{back}/ckpt-{step:08d}.h5")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), step
        a, b = _params(f"{skip}/ckpt-{step:08d}.h5", "compress"), _params(f"{back}/ckpt-{step:08d}.h5", "compress")
        assert a and a.keys() == b.keys(), (step, sorted(a), sorted(b))
        assert all(np.array_equal(a[k], b[k]) for k in a), (step, [k for k in a if not np.array_equal(a[k], b[k])])
        assert all(np.isfinite(v).all() for v in a.values())


@SHARED_LAUNCH
def test_rollback_to_a_save_before_compression_started_clears_the_compressor_state(guard_jobs):
    """The bad step (25) poisons rank 1's residuals with NaN; the rollback goes to step 20, saved before
    compression started (22), so the file holds no compressor state: the trainer's must still be
    cleared, else the replay's first compressed step sends the NaN again and rolls back until abort."""
    ckpt, proc = guard_jobs["ef"]  # guard.max_bad_steps=2
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"guard: rolled back to {ckpt}/ckpt-00000020.h5 (step 20)" in proc.stdout, proc.stdout
    assert _metrics(ckpt)[-1]["bad_steps"] == 1
    assert all(np.isfinite(v).all() for v in _params(f"{ckpt}/ckpt-00000060.h5").values())


@SHARED_LAUNCH
def test_loss_spike_guard(guard_jobs):
    ckpt, proc = guard_jobs["spike"]  # skip, guard.spike_zscore=6 over a window of 10, fault spike:40:1
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "guard: loss spike at step 40" in proc.stdout, proc.stdout
    assert [r["step"] for r in _metrics(ckpt) if r["skipped"]] == [41]


def test_too_many_bad_steps_abort(small_data, tmp_path):
    ckpt = str(tmp_path / "many")
    proc = _run(small_data[0], ckpt, 2, "--set", "guard.nonfinite=skip", "--set", "guard.max_bad_steps=2",
                fault="nan:11:0,nan:12:1,nan:13:0")
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    assert proc.stderr.count("hpctrain: error:") == 1 and "more than guard.max_bad_steps=2" in proc.stderr


# ---- the same verdicts on the (simulated) GPU ------------------------------------------------
@pytest.mark.parametrize("compress", ["none", "topk(0.1)"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_skip_on_each_device_in_process(small_data, tmp_path, monkeypatch, device, compress):
    """A 1-rank trainer on the CPU and on numba's CUDA device (the simulator in CI): the NaN of
    step 2 is found in the averaged gradient by the device's all_finite op and the step skipped.
    With compression (on the device path on CUDA) the skipped step leaves its state as it was."""
    from mpi4py import MPI

    from hpctrain.training.config import Config
    from hpctrain.device import cuda_status
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    if device == "cuda" and cuda_status()[0] == 0:
        pytest.skip("numba.cuda unusable")
    monkeypatch.setenv("HPCTRAIN_FAULT", "nan:2")
    cfg = Config()
    cfg.data.train, cfg.data.eval, cfg.model.hidden = small_data[0], "", [16]
    cfg.train.global_batch, cfg.train.steps, cfg.train.device, cfg.train.log_every = 8, 4, device, 10**6
    cfg.checkpoint.dir, cfg.checkpoint.every_minutes, cfg.guard.nonfinite = str(tmp_path), 0.0, "skip"
    cfg.dist.compress = compress
    t = Trainer(cfg.validate(), init_world(MPI.COMM_SELF))
    before, kept = [], []
    compute = t.stepper.run

    def recording(at, x, y, votes=None):
        before.append(t.device.to_host(t.model.flat.data).copy())
        if t.compression is not None:
            kept.append({k: np.array(v, copy=True) for k, v in t.compression.state().items()})
        return compute(at, x, y, votes)
    t.stepper.run = recording
    result = t.run()
    assert result["steps"] == 4 and result["bad_steps"] == 1
    params = t.device.to_host(t.model.flat.data)
    assert np.isfinite(params).all()
    np.testing.assert_array_equal(before[2], before[3])  # step 2 changed nothing
    assert not np.array_equal(before[1], before[2])      # the others did
    if compress != "none":
        assert t.compression.on_device == (device == "cuda")
        assert sorted(kept[2]) == sorted(kept[3]) == ["residual/0"]
        assert all(np.array_equal(kept[2][k], kept[3][k]) for k in kept[2])  # nor the residuals
        assert not np.array_equal(kept[1]["residual/0"], kept[2]["residual/0"])

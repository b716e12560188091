"""The tests' fault hooks enter a run through one seam (hpctrain/reliability/faults.py): read from
the environment once, then handed to the code that acts on them (a checkpoint save calls
``before_commit`` and ``before_close``), so no production path reads the environment for them."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.ckpt.state import Entry
from hpctrain.errors import ConfigError
from hpctrain.reliability import faults as faults_mod
from hpctrain.reliability.faults import Faults


def test_the_save_hooks_act_only_at_their_step_and_rank(monkeypatch):
    slept, stopped = [], []
    monkeypatch.setattr(faults_mod.time, "sleep", slept.append)
    monkeypatch.setattr(faults_mod.os, "kill", lambda pid, sig: stopped.append(sig))
    env = {"HPCTRAIN_CKPT_WRITE_DELAY_S": "2.5", "HPCTRAIN_CKPT_DELAY_STEP": "10", "HPCTRAIN_CKPT_STOP_RANK": "1"}
    for rank in (0, 1):
        hooks = Faults(rank, env=env)
        for step in (5, 10):
            hooks.before_commit(step)
            hooks.before_close(step)
    assert slept == [2.5, 2.5]                          # step 10 only, on both ranks
    assert stopped == [faults_mod.signal.SIGSTOP]       # rank 1 at step 10 only
    every = Faults(0, env={"HPCTRAIN_CKPT_WRITE_DELAY_S": "1"})
    every.before_commit(3), every.before_commit(4)
    assert slept[2:] == [1.0, 1.0]                      # no step named: every save
    quiet = Faults(0, env={})
    quiet.before_commit(1), quiet.before_close(1)
    assert len(slept) == 4 and len(stopped) == 1


def test_faults_are_read_from_the_environment_given_not_the_process(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_FAULT", "nan:3")
    assert Faults(0).by_step == {3: "nan"}
    assert Faults(0, env={}).by_step == {}
    with pytest.raises(ConfigError, match="HPCTRAIN_CKPT_DELAY_STEP='soon': expected a number"):
        Faults(0, env={"HPCTRAIN_CKPT_DELAY_STEP": "soon"})


def test_a_checkpoint_save_calls_the_hooks_it_is_given(tmp_path):
    from mpi4py import MPI

    from hpctrain.ckpt.write import mpi_hdf5, write_checkpoint
    from hpctrain.runtime import init_world

    class Recording:
        def __init__(self):
            self.calls = []

        def before_commit(self, step):
            self.calls.append(("commit", step))

        def before_close(self, step):
            self.calls.append(("close", step))

    a = np.arange(12.0).reshape(3, 4)
    entries = [Entry("/model/a/weight", a.shape, a.dtype, lambda lo, hi: a[lo:hi])]
    hooks = Recording()
    write_checkpoint(str(tmp_path), 7, entries, {"epoch": 0}, init_world(MPI.COMM_SELF), hooks=hooks)
    # the serial fallback (h5py without MPI) has no collective close to stop before
    assert hooks.calls == [("commit", 7)] + ([("close", 7)] if mpi_hdf5() else [])
    write_checkpoint(str(tmp_path), 8, entries, {"epoch": 0}, init_world(MPI.COMM_SELF))  # no hooks: nothing


def test_a_step_delay_paces_every_step_not_start_up(monkeypatch):
    slept = []
    monkeypatch.setattr(faults_mod.time, "sleep", slept.append)
    hooks = Faults(2, env={"HPCTRAIN_STEP_DELAY_S": "0.25"})
    x = np.ones((2, 3))
    for step in range(3):
        hooks.pace()
        assert hooks.before_step(step, x) is x   # the batch untouched: the pace is apart from the faults
    hooks.at_start_up()
    assert slept == [0.25, 0.25, 0.25]

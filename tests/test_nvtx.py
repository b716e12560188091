"""NVTX ranges (train.nvtx, hpctrain/observe/nvtx.py): what a training run pushes and pops.

CuPy's NVTX bindings need a CUDA library; here they are replaced by a recorder of the same
two calls, so the test checks the ranges a run opens (names, nesting, threads, balance), not
NVTX itself. A real GPU run under ``nsys profile -t cuda,nvtx`` shows them.
"""

from __future__ import annotations

import threading

import pytest

from hpctrain.errors import ConfigError
from hpctrain.observe import nvtx

from test_cli import train_in_process
from test_gpt_train import gpt_args

pytestmark = pytest.mark.timeout(240)


class Recorder:
    """push / pop per thread, with each range's enclosing ranges."""

    def __init__(self):
        self.stacks, self.ranges, self.errors = {}, [], []

    def bindings(self):
        def push(name):
            stack = self.stacks.setdefault(threading.current_thread().name, [])
            stack.append(name)
            self.ranges.append((threading.current_thread().name, tuple(stack)))

        def pop():
            stack = self.stacks.get(threading.current_thread().name)
            if not stack:
                self.errors.append(f"pop without a push on {threading.current_thread().name}")
                return
            stack.pop()
        return push, pop


def _train(text_data, tmp_path, *extra):
    train_in_process(*gpt_args(text_data, "--set", f"checkpoint.dir={tmp_path}", "--set", "train.metrics=", *extra))


def test_a_run_opens_a_range_per_step_phase_block_and_bucket(text_data, tmp_path, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(nvtx, "_bindings", rec.bindings)
    # small buckets: the communication thread reduces all but the last, which the main thread
    # reduces in its wait once backward is over
    _train(text_data, tmp_path, "--set", "train.steps=2", "--set", "train.nvtx=true", "--set",
           "train.grad_accum_steps=2", "--set", "dist.bucket_mb=0.005", "--set", "dist.first_bucket_mb=0.005")
    assert not rec.errors and all(not s for s in rec.stacks.values()), (rec.errors, rec.stacks)  # balanced
    main = [path for thread, path in rec.ranges if thread == "MainThread"]
    for step in (1, 2):
        assert (f"step {step}",) in main
        for phase in ("data", "forward", "backward", "allreduce", "optimizer"):
            assert (f"step {step}", phase) in main, (step, phase)
        for block in ("h.0", "h.1"):   # blocks nested in their phase
            assert (f"step {step}", "forward", f"forward {block}") in main
            assert (f"step {step}", "backward", f"backward {block}") in main
    # two micro-batches: two forward ranges a step
    assert main.count(("step 1", "forward")) == 2
    comm = [path for thread, path in rec.ranges if thread == "hpctrain-comm"]
    assert ("comm bucket 0",) in comm, comm
    # each bucket once a step (4 buckets of the tiny GPT at 0.005 MB), on whichever thread reduced it;
    # on the main thread, inside the all-reduce wait
    buckets = [p[-1] for _, p in rec.ranges if p[-1].startswith("comm bucket")]
    assert sorted(buckets) == sorted(f"comm bucket {i}" for i in range(4) for _ in range(2)), buckets
    assert all(p[1] == "allreduce" for p in main if p[-1].startswith("comm bucket")), main


def test_off_no_range_is_opened(text_data, tmp_path, monkeypatch):
    def refuse():
        raise AssertionError("NVTX asked for with train.nvtx = false")
    monkeypatch.setattr(nvtx, "_bindings", refuse)
    _train(text_data, tmp_path, "--set", "train.steps=1")


def test_without_cupy_the_switch_is_one_config_error():
    try:
        import cupy.cuda.nvtx  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or unloadable: the case under test
        with pytest.raises(ConfigError, match="train.nvtx = true needs CuPy's NVTX bindings"):
            nvtx.make_ranges(True)
    else:
        pytest.skip("CuPy's NVTX imports here")
    assert nvtx.make_ranges(False) is None

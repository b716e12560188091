"""CUDA graphs of a micro-batch's forward and backward (train.cuda_graphs, hpctrain/training/cuda_graphs.py).

numba's simulator has no graphs, so here the device's ``capture`` and ``replay`` are stood in
for by a recorder with a graph's semantics: while the step's work is captured, every kernel
launch (and every batched GEMM of the attention) is recorded with its configuration and its
arguments and nothing runs; a replay runs the records in order with those same arguments.
While capturing, a host read of the device, a wait for it or an allocation raises, as they
would break or escape a real capture. So a step that changed any kernel argument between
steps, read a result on the host mid-step, or allocated after its warm-up would train
differently here from the eager run, or fail. On a GPU, CuPy's stream capture is the real
thing (scripts/cuda-tests.txt runs test_gpu_graphs_replay_the_eager_step_bit_for_bit there).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.device import CudaDevice, cuda_status, simulated
from hpctrain.training.cuda_graphs import StepGraphs, why_not
from steps import train_losses

pytestmark = [pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}"),
              pytest.mark.timeout(600)]


class CaptureError(RuntimeError):
    pass


class SimulatedGraphs:
    """capture / replay / can_capture for CudaDevice on the simulator (see the module docstring)."""

    def __init__(self, monkeypatch):
        from numba.cuda.simulator import api, kernel as sim
        from numba.cuda.simulator.cudadrv import devicearray

        from hpctrain.kernels.support import batched_gemm

        self.recording, self.captures, self.replays = None, 0, 0
        launch, gemm = sim.FakeCUDAKernel.__call__, batched_gemm.HostBatchedGemm.__call__
        self._launch, self._gemm = launch, gemm
        graphs = self

        def kernel_call(k, *args):
            if graphs.recording is None or k._device:
                return launch(k, *args)
            graphs.recording.append(("kernel", k, (k.grid_dim, k.block_dim, k.dynshared_size), args))
            return None

        def gemm_call(executor, *args):
            if graphs.recording is None:
                return gemm(executor, *args)
            graphs.recording.append(("gemm", executor, None, args))
            return None

        def refuse(what, original):
            def guarded(*args, **kwargs):
                if graphs.recording is not None:
                    raise CaptureError(f"{what} while capturing")
                return original(*args, **kwargs)
            return guarded

        monkeypatch.setattr(sim.FakeCUDAKernel, "__call__", kernel_call)
        monkeypatch.setattr(batched_gemm.HostBatchedGemm, "__call__", gemm_call)
        monkeypatch.setattr(api.stream, "synchronize", refuse("a stream synchronize", api.stream.synchronize))
        monkeypatch.setattr(devicearray.FakeCUDAArray, "copy_to_host",
                            refuse("a copy to the host", devicearray.FakeCUDAArray.copy_to_host))
        monkeypatch.setattr(CudaDevice, "empty", refuse("an allocation", CudaDevice.empty))
        monkeypatch.setattr(CudaDevice, "can_capture", lambda dev: (True, ""))
        monkeypatch.setattr(CudaDevice, "capture", lambda dev, fn: self.capture(fn))
        monkeypatch.setattr(CudaDevice, "replay", lambda dev, graph: self.replay(graph))

    def capture(self, fn):
        self.recording = []
        try:
            fn()
        finally:
            graph, self.recording = self.recording, None
        self.captures += 1
        return graph

    def replay(self, graph):
        self.replays += 1
        for kind, obj, config, args in graph:
            if kind == "kernel":
                obj.grid_dim, obj.block_dim, obj.dynshared_size = config
                self._launch(obj, *args)
            else:
                self._gemm(obj, *args)


def _train(text, steps, graphs, attention="flash", accumulate=2):
    """(per-step (loss, correct), final parameters, the step's StepGraphs) of a tiny GPT on
    the simulated CUDA device in this process. Buckets of 1 KB: several, so that the communication
    thread is still reducing later buckets while the optimizer updates (and captures) the first."""
    from mpi4py import MPI

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer
    from test_gpt_cuda_step import _config

    cfg = _config(text, "cuda", steps=steps)
    cfg.train.grad_accum_steps, cfg.train.cuda_graphs, cfg.model.attention = accumulate, graphs, attention
    cfg.dist.bucket_mb = cfg.dist.first_bucket_mb = 0.001
    trainer = Trainer(cfg, init_world(MPI.COMM_SELF), Log(False))
    try:
        losses = train_losses(trainer, steps)
        return losses, trainer.device.to_host(trainer.model.flat.data).copy(), getattr(trainer.stepper.runner, "graphs", None)
    finally:
        trainer.close()


# two micro-batches a step: step 1 runs both keys eagerly; step 2 captures them (and runs them
# eagerly: a capture runs nothing); step 3 replays each and checks it against the eager step;
# step 4 replays
STEPS = 4


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A token file of 13 symbols: the tied head's simulated GEMMs over 256 byte symbols took
    most of a step's 10 s on the simulator."""
    from test_gpt_train import _token_file

    return _token_file(tmp_path_factory.mktemp("graphs") / "v13.h5", 13)


@pytest.fixture(scope="module")
def eager(tokens):
    losses, params, graphs = _train(tokens, STEPS, "off")
    assert graphs is None
    return losses, params


def test_graphed_steps_train_bit_for_bit_as_eager_ones(tokens, eager, monkeypatch):
    """The keys are the first micro-batch's (the loss written, the gradient written), the
    second's (both added) and AdamW's update of each bucket, whose learning rate and bias
    corrections change every step in device memory. The communication thread's launches while an
    update is captured would be recorded into its graph (the recorder takes every thread's, as
    CuPy's relaxed capture does): the steps that capture and check wait for every bucket first.
    Losses, counts and parameters equal the eager run's bit for bit."""
    from hpctrain.comm.buckets import BucketedAllreduce

    sim = SimulatedGraphs(monkeypatch)
    reducers, early = [], []
    wait, update = BucketedAllreduce.wait, StepGraphs.update

    def spy_wait(reducer, bucket):
        reducers.append(reducer)
        return wait(reducer, bucket)

    def spy_update(graphs, optimizer, lo, hi):
        # a capture or check while a bucket is still being reduced would record its launches
        if graphs.settling(graphs.update_key(optimizer, lo, hi)) and not all(e.is_set() for e in reducers[-1]._done):
            early.append((lo, hi))
        return update(graphs, optimizer, lo, hi)
    monkeypatch.setattr(BucketedAllreduce, "wait", spy_wait)
    monkeypatch.setattr(StepGraphs, "update", spy_update)
    graphed, params, graphs = _train(tokens, STEPS, "on")
    assert graphs is not None and not graphs.failed and not early, (graphs.failed, early)
    kinds = sorted(key[0] for key in graphs.graphs)
    buckets = kinds.count("update")
    assert buckets >= 3 and kinds == ["micro-batch"] * 2 + ["update"] * buckets, kinds
    assert sim.captures == graphs.captures == 2 + buckets and sim.replays == graphs.replays == 2 * (2 + buckets)
    assert graphed == eager[0]
    assert params.tobytes() == eager[1].tobytes()


def _said(monkeypatch):
    from hpctrain.observe.log import Log

    said = []
    monkeypatch.setattr(Log, "warn", lambda self, msg: said.append(msg))
    return said


def test_a_capture_that_fails_leaves_the_steps_eager_and_says_why_once(tokens, eager, monkeypatch):
    SimulatedGraphs(monkeypatch)
    said = _said(monkeypatch)
    monkeypatch.setattr(CudaDevice, "capture", lambda dev, fn: (_ for _ in ()).throw(RuntimeError("no graphs here")))
    # step 2's captures fail: both keys, said once. Two steps compare with the four-step run's first
    # two: step 2's loss follows one update at the schedule's first lr, the same for any run length
    graphed, _, graphs = _train(tokens, 2, "on")
    assert graphs.failed == "capturing micro-batch work failed (RuntimeError: no graphs here)" and not graphs.graphs
    assert len([m for m in said if "capturing micro-batch work failed" in m]) == 1, said
    assert graphed == eager[0][:2]


def test_a_graph_that_missed_work_is_caught_by_its_checked_replay(tokens, eager, monkeypatch):
    """A capture whose work escaped it (run for real, nothing recorded: an empty graph). Its first
    replay, on step 3's batches, leaves step 2's gradient: the check finds it, graphs stop (said
    once) and every step keeps the eager results."""
    sim = SimulatedGraphs(monkeypatch)
    said = _said(monkeypatch)
    monkeypatch.setattr(CudaDevice, "capture", lambda dev, fn: (fn(), [])[1])
    graphed, params, graphs = _train(tokens, STEPS, "on")   # the eager run's length: its lr schedule
    assert graphs.failed.startswith("the first replay's ") and "differs from the eager step's" in graphs.failed
    assert not graphs.graphs and sim.replays == 1 and len(said) == 1, (graphs.failed, said)
    assert graphed == eager[0] and params.tobytes() == eager[1].tobytes()


def test_where_graphs_cannot_run_the_reason_is_named():
    from types import SimpleNamespace as NS

    from hpctrain.training.config import Config

    cfg = Config()
    dev = NS(name="cuda", can_capture=lambda: (True, ""))
    plan = NS(tensor=None, dp=NS(size=1), pipeline=1)
    assert why_not(cfg, dev, plan) == ""
    cfg.train.cuda_graphs = "off"
    assert why_not(cfg, dev, plan) == "train.cuda_graphs = off"
    cfg.train.cuda_graphs = "auto"
    assert "the device is cpu" in why_not(cfg, NS(name="cpu"), plan)
    assert "CuPy is not installed" in why_not(cfg, NS(name="cuda", can_capture=lambda: (False, "CuPy is not installed")),
                                              plan)
    for key, value, words in (("trace", "/tmp/t", "train.trace"), ("op_times", True, "train.op_times"),
                              ("sync_phases", True, "train.sync_phases")):
        setattr(cfg.train, key, value)
        assert words in why_not(cfg, dev, plan)
        setattr(cfg.train, key, Config().train.__dict__[key])
    assert "tensor parallelism" in why_not(cfg, dev, NS(tensor=object(), dp=NS(size=1), pipeline=1))
    assert "pipeline parallelism" in why_not(cfg, dev, NS(tensor=None, dp=NS(size=1), pipeline=2))
    cfg.dist.zero = 2
    assert "ZeRO-2" in why_not(cfg, dev, plan)
    cfg.dist.zero = 0
    assert "keeps 4 data-parallel ranks eager" in why_not(cfg, dev, NS(tensor=None, dp=NS(size=4), pipeline=1))
    cfg.train.cuda_graphs = "on"
    assert why_not(cfg, dev, NS(tensor=None, dp=NS(size=4), pipeline=1)) == ""
    if simulated():
        assert CudaDevice("float64").can_capture() == (False, "numba's CUDA simulator has no graphs")


@pytest.mark.gpu
def test_gpu_graphs_replay_the_eager_step_bit_for_bit(tokens):
    """On a GPU with CuPy: the same comparison through CuPy's real stream capture."""
    ok, why = CudaDevice("float64").can_capture()
    if not ok:
        pytest.skip(why)
    for attention in ("flash", "gemm"):   # gemm: cuBLAS's strided-batched calls in the graph too
        eager, p_eager, _ = _train(tokens, STEPS, "off", attention)
        graphed, p_graphed, graphs = _train(tokens, STEPS, "on", attention)
        assert not graphs.failed and graphs.captures == 2 and graphs.replays == 4, graphs.failed
        assert graphed == eager and p_graphed.tobytes() == p_eager.tobytes()


def _fakes(grad, replay, slots=None):
    """A model and device for StepGraphs alone: forward and backward record their calls."""
    from types import SimpleNamespace as NS

    calls = []

    def backward(accumulate=False, ready=None):
        calls.append(("b", accumulate))
        grad[:] = 1.0
        if ready:
            ready("w")
    model = NS(forward=lambda x, y, totals=None, accumulate=False: calls.append(("f", accumulate)),
               backward=backward, flat=NS(grad=grad, slots=slots or [NS(name="w", offset=0, size=grad.size)]))
    device = NS(capture=lambda fn: (fn(), "graph")[1], replay=lambda g: (calls.append(("replay", g)), replay(grad)),
                to_host=lambda a: a, copy_from_host=lambda dst, src: dst.__setitem__(slice(None), src))
    return model, device, calls


def test_graph_updates_under_zero_1_wait_for_every_bucket_whatever_this_rank_captures():
    """ZeRO-1's updates end in parameter all-gathers, which every rank must call in one order against
    the bucket reductions. Whether an update key is captured or checked may differ between ranks (a
    capture that failed on one GPU only), so under ZeRO-1 a graph run's updates always wait for every
    bucket; without ZeRO they wait only while this rank captures or checks one."""
    from types import SimpleNamespace as NS

    from hpctrain.training.runners import GraphRunner

    optimizer = NS(graph_key=lambda: ())
    for shards, waits in ((None, False), (object(), True)):
        runner = GraphRunner(NS(shards=shards, device=NS()), NS(), timers=None)
        assert runner.update_waits(optimizer, [(0, 4), (4, 8)]) is waits   # a first call: nothing settling
        runner.graphs._seen.add(runner.graphs.update_key(optimizer, 0, 4))   # seen once: the next call captures
        assert runner.update_waits(optimizer, [(0, 4), (4, 8)]) is True
        runner.graphs.failed = "capturing update work failed (on this rank only)"
        assert runner.update_waits(optimizer, [(0, 4)]) is waits


def test_graphed_micro_batches_key_by_shape_and_flags():
    model, device, calls = _fakes(np.zeros(3), lambda grad: grad.__setitem__(slice(None), 1.0))
    g = StepGraphs(device, model)
    x, y = np.zeros((2, 3)), np.zeros((2, 3))
    for _ in range(4):
        g.run(x, y, np.zeros(2), False, False)
    # eager; captured (the body runs under capture), then eager; replayed and checked (then eager); replayed
    assert calls == [("f", False), ("b", False)] * 3 + [("replay", "graph"), ("f", False), ("b", False),
                                                        ("replay", "graph")] and g.ready_order == ["w"]
    assert g.captures == 1 and g.replays == 2 and not g.failed
    g.run(np.zeros((1, 3)), np.zeros((1, 3)), np.zeros(2), False, True)   # a new key: eager first
    assert calls[-2:] == [("f", False), ("b", True)]


def test_a_replay_that_differs_from_the_eager_step_ends_the_graphs():
    from types import SimpleNamespace as NS

    grad = np.zeros(3)
    model, device, calls = _fakes(grad, lambda grad: grad.__setitem__(slice(None), 2.0))   # eager writes 1.0
    said = []
    g = StepGraphs(device, model, NS(warn=said.append))
    x = np.zeros((2, 3))
    for _ in range(4):
        g.run(x, x, np.zeros(2), False, False)
    assert g.failed == "the first replay's gradient of w differs from the eager step's by 1.0e+00 of its scale"
    assert not g.graphs and len(said) == 1 and np.all(grad == 1.0) and g.replays == 1   # the eager results stand


def test_an_update_graph_that_froze_its_learning_rate_is_caught():
    """The update's check compares what the replay changed with what the eager update changed, so a
    graph that kept the capture's learning rate (a scalar passed by value, not read from device
    memory) is caught even where the parameters hardly move against their own size: here the lr
    goes from 1.0e-3 to 1.1e-3 on parameters of 1, a difference of 1e-4 of the parameters but
    0.09 of the change."""
    from types import SimpleNamespace as NS

    data, hyper = np.ones(4), np.zeros(1)
    flat = NS(data=data, slots=[NS(name="w", offset=0, size=4)])
    optimizer = NS(state_of=lambda lo, hi: {}, graph_key=lambda: (), update=lambda lo, hi: data.__isub__(hyper[0]))

    def capture(fn):
        frozen = float(hyper[0])
        return lambda: data.__isub__(frozen)
    device = NS(capture=capture, replay=lambda graph: graph(), to_host=lambda a: a,
                copy_from_host=lambda dst, src: dst.__setitem__(slice(None), src))
    said = []
    g = StepGraphs(device, NS(flat=flat), NS(warn=said.append))
    for lr in (1.0e-3, 1.0e-3, 1.1e-3):   # eager; captured at 1.0e-3; replayed and checked at 1.1e-3
        hyper[0] = lr
        g.update(optimizer, 0, 4)
    assert g.failed.startswith("the first replay's update of w differs from the eager step's by 9.1e-02"), g.failed
    assert len(said) == 1 and np.allclose(data, 1.0 - 3.1e-3, rtol=0, atol=1e-12)   # the eager updates stand

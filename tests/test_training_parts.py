"""The trainer's three parts, each used without the others (one process, no mpirun):

* the plan (hpctrain/training/plan.py): the grid, groups, buckets and ZeRO shares of a config,
  placed for real on one rank and on paper for a rank of a larger world;
* the step (hpctrain/training/step.py): a batch in, a StepResult out, the update exactly SGD
  on the averaged gradient where the update policy applies it and none where it does not,
  micro-batches adding up to the whole batch's gradient;
* the run loop (hpctrain/training/loop.py) over a stand-in step, data and checkpoints: which steps
  it saves, what the numeric guard does to a bad step, a stop signal.
"""

from __future__ import annotations

import io
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.errors import TrainingDiverged
from hpctrain.observe.log import Log, Metrics, Timers
from hpctrain.reliability.numeric_guard import NumericGuard
from hpctrain.reliability.progress import Progress
from hpctrain.runtime import World
from hpctrain.training.config import Config
from hpctrain.training.loop import Reporting, RunLoop, Watching
from hpctrain.training.plan import on_paper, place
from hpctrain.training.state import TrainingState
from hpctrain.training.step import Step, StepResult
from hpctrain.training.update_policy import APPLIED, SKIPPED, UpdatePolicy


def _config(data: str, **train) -> Config:
    cfg = Config()
    cfg.data.train, cfg.data.eval, cfg.model.hidden = data, "", [16, 8]
    cfg.train.dtype, cfg.train.device, cfg.train.global_batch = "float64", "cpu", 32
    cfg.optim.name, cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay = "sgd", 0.1, 0.0, 0.0
    cfg.optim.warmup_steps, cfg.optim.schedule, cfg.optim.scale_lr = 0, "constant", False
    cfg.dist.bucket_mb, cfg.dist.first_bucket_mb, cfg.dist.allreduce = 0.0005, 0.0005, "mpi"
    cfg.guard.nonfinite = "skip"   # a bad step's update is dropped, and the step says so
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg.validate()


def _self_world():
    from mpi4py import MPI

    from hpctrain.runtime import init_world

    return init_world(MPI.COMM_SELF)


def _model_on(plan, cfg):
    from hpctrain.models import family

    models = family(cfg.model.kind)
    data = models.open_data(cfg, plan.dp, plan.device)
    model = models.build(cfg, plan.device, data, tensor=plan.tensor)
    model.init(cfg.train.seed)
    return data, model


# ---- the plan ---------------------------------------------------------------------------
def test_the_plan_divides_the_parameters_into_buckets_and_zero_shares(small_data):
    cfg = _config(small_data[0])
    cfg.dist.zero = 1
    plan = place(cfg, _self_world())
    data, model = _model_on(plan, cfg)
    try:
        plan.divide(model)
    finally:
        data.close()
    # the buckets tile the flat buffer in backward's order: the last layers' first
    assert len(plan.buckets) >= 2
    assert plan.buckets[0].hi == model.flat.size and plan.buckets[-1].lo == 0
    assert all(a.lo == b.hi for a, b in zip(plan.buckets, plan.buckets[1:]))
    # one rank owns every element of every bucket
    assert sum(hi - lo for lo, hi, _ in plan.shards.pieces) == model.flat.size
    assert plan.dp.size == 1 and plan.grid.tensor is None and plan.micro_batches == 1
    assert plan.allreduce is None  # connect() is a separate, collective stage
    text = plan.describe()
    assert "plan: 1 rank(s) = data 1 x tensor 1 x pipeline 1" in text
    assert f"{len(plan.buckets)} gradient bucket(s)" in text and "zero 1" in text


def test_a_plan_on_paper_places_a_rank_of_a_larger_world(small_data):
    """Rank 3 of 4 with dist.tensor_parallel = 2: tensor rank 1 of group [2, 3], data rank 1 of
    group [1, 3]; no communicator is made and no memory taken."""
    cfg = _config(small_data[0])
    cfg.model.kind, cfg.dist.tensor_parallel = "mlp", 1
    world = World(None, 3, 4, None, 3, 4, None, 0, 1)
    plan = on_paper(cfg, world)
    assert (plan.dp.rank, plan.dp.size, plan.grid.tensor) == (3, 4, None)
    cfg.dist.tensor_parallel = 2
    plan = on_paper(cfg, world)
    assert (plan.grid.tensor.rank, plan.grid.tensor.size, plan.dp.rank, plan.dp.size) == (1, 2, 1, 2)
    assert plan.dp.comm is None and plan.device.name == "cpu"
    assert "tensor groups [0, 1] [2, 3]; data groups [0, 2] [1, 3]" in plan.describe()


# ---- the step ----------------------------------------------------------------------------
def _step(cfg, small_data):
    """A connected one-rank plan, the model's state and its Step (no loop, no checkpoints)."""
    from hpctrain.optim import LRSchedule, make_optimizer

    plan = place(cfg, _self_world())
    data, model = _model_on(plan, cfg)
    plan.divide(model)
    plan.connect(Log(False))
    optimizer = make_optimizer(plan.device, model.flat, cfg.optim, model.no_decay)
    state = TrainingState(model, optimizer, data.sampler, np.random.default_rng(0))
    policy = UpdatePolicy(NumericGuard(cfg.guard, Log(False)))
    step = Step(plan, state, LRSchedule(cfg.optim, cfg.optim.lr, cfg.train.steps), policy, Timers())
    return step, state, data


def test_a_step_takes_a_batch_and_returns_its_statistics_and_the_sgd_update(small_data):
    cfg = _config(small_data[0])
    step, state, data = _step(cfg, small_data)
    try:
        x, y = data.reader.batch(0)
        model = state.model
        before = model.flat.data.copy()
        # the statistics are the model's own on this batch
        loss_ref, correct_ref = model.forward(x, y)
        result = step.run(0, x, y, votes=lambda: [3, 0])
        assert isinstance(result, StepResult) and not result.bad_loss_ranks and not result.bad_grad_ranks
        assert result.loss_sum == loss_ref and result.correct == correct_ref and result.predictions == len(y)
        assert result.outcome == APPLIED and result.votes == (3, 0) and result.lr == 0.1
        grad = model.flat.grad.copy()
        assert np.abs(grad).max() > 0
        # plain SGD, lr 0.1: p - lr g, bit for bit in float64 (the skip policy waited for the verdict)
        np.testing.assert_array_equal(model.flat.data, before - 0.1 * grad)
        assert state.step == 0  # the step never advances the state: the loop does
        assert result.comm["bytes_reduced"] == 8 * model.flat.size and result.comm["allreduce"] == "mpi"
        record = result.metrics()
        assert record["loss"] == loss_ref / len(y) and not record["skipped"] and "t_forward" in record
    finally:
        data.close()


def test_a_step_the_policy_refuses_leaves_the_parameters_as_they_were(small_data):
    cfg = _config(small_data[0])
    step, state, data = _step(cfg, small_data)
    try:
        x, y = data.reader.batch(0)
        x = np.array(x, copy=True)
        x[0, 0] = np.nan
        before = state.model.flat.data.copy()
        result = step.run(0, x, y)
        assert result.outcome == SKIPPED and "NaN/Inf" in result.reason and result.metrics()["skipped"]
        np.testing.assert_array_equal(state.model.flat.data, before)   # no update applied
    finally:
        data.close()


@pytest.mark.parametrize("nonfinite, clip", [("abort", 0.0), ("abort", 1e9), ("skip", 1e9), ("rollback", 0.0)])
def test_every_update_path_applies_the_sgd_step_once(small_data, nonfinite, clip):
    """Following the buckets (abort, no clipping), after all of them (clipping: a limit this step
    stays under) or after the verdict (skip, rollback): the same p - lr g, bit for bit in float64,
    and AdamW's step count advanced once."""
    cfg = _config(small_data[0])
    cfg.guard.nonfinite, cfg.optim.clip_grad_norm = nonfinite, clip
    step, state, data = _step(cfg.validate(), small_data)
    try:
        x, y = data.reader.batch(0)
        before = state.model.flat.data.copy()
        assert step.run(0, x, y).outcome == APPLIED
        np.testing.assert_array_equal(state.model.flat.data, before - 0.1 * state.model.flat.grad)
    finally:
        data.close()
    cfg.optim.name = "adamw"
    step, state, data = _step(cfg.validate(), small_data)
    try:
        step.run(0, *data.reader.batch(0))
        assert state.optimizer.t == 1
    finally:
        data.close()


def test_micro_batches_add_up_to_the_whole_batch_gradient(small_data):
    grads = []
    for k in (1, 4):
        step, state, data = _step(_config(small_data[0], grad_accum_steps=k), small_data)
        try:
            x, y = data.reader.batch(0)
            step.run(0, x, y)
            grads.append(state.model.flat.grad.copy())
        finally:
            data.close()
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-12, atol=1e-15)


def test_a_poisoned_batch_is_reported_not_finite(small_data):
    """A NaN feature: ReLU may hide it from the loss, never from the averaged gradient."""
    step, state, data = _step(_config(small_data[0]), small_data)
    try:
        x, y = data.reader.batch(0)
        x = np.array(x, copy=True)
        x[0, 0] = np.nan
        result = step.run(0, x, y)
        assert result.bad_grad_ranks == 1 and not np.isfinite(state.model.flat.grad).all()
    finally:
        data.close()


def test_a_clipped_step_reports_a_non_finite_norm_without_the_bucket_test(small_data):
    """guard.check_grads off: the reducer tests no bucket, but the gradient norm clipping computes
    is NaN, so the step is still reported non-finite (and the gradient is not scaled)."""
    cfg = _config(small_data[0])
    cfg.guard.check_grads, cfg.optim.clip_grad_norm = False, 0.1
    step, state, data = _step(cfg.validate(), small_data)
    try:
        x, y = data.reader.batch(0)
        result = step.run(0, x, y)
        assert not result.bad_grad_ranks and step.clip.norm > 0.1 and step.clip.coefficient < 1.0
        assert result.clip["grad_norm"] == step.clip.norm
        x = np.array(x, copy=True)
        x[0, 0] = np.nan
        result = step.run(1, x, y)
        assert result.bad_grad_ranks == 1 and math.isnan(step.clip.norm) and step.clip.coefficient == 1.0
    finally:
        data.close()


# ---- the run loop ------------------------------------------------------------------------
class FakeStep:
    """A step whose loss is given per step (NaN for a bad one), judged by the real update policy
    over the loop's guard; records its runs and the updates the policy applied."""

    def __init__(self, losses, schedule, policy, device):
        self.losses, self.schedule, self.policy, self.device, self.updates, self.runs = \
            losses, schedule, policy, device, [], []

    def run(self, step, x, y, votes=None):
        launched = self.device.launches()
        self.runs.append(step)
        loss = self.losses.get(step, 1.0)
        outcome, reason = self.policy.decide(step, loss, int(not math.isfinite(loss)), 0)
        if outcome == APPLIED:
            self.updates.append(step)
        return StepResult(step, outcome, reason, loss * len(y), len(y) // 2, len(y), int(not math.isfinite(loss)),
                          0, tuple(int(v) for v in (votes() if votes else ())), self.schedule.lr(step), None,
                          comm={"comm_time": 0.0}, launches=self.device.launches() - launched)


class FakeCheckpoints:
    def __init__(self, every):
        self.every, self.saved, self.saved_step = every, [], None

    def step_due(self, step):
        return step % self.every == 0

    def time_due(self):
        return False

    def save(self, state, wait=True, watch=None):
        """Saves at once; one that could go on in the background (``wait`` False) is finished
        by the next call of ``wait`` (as the loop calls it at the end)."""
        self.saved.append(state.step)
        self.saved_step = state.step
        self.in_flight = None if wait else state.step
        if watch is not None:
            with watch():
                pass

    in_flight = None

    def wait(self):
        self.in_flight = None

    def rollback(self, state):  # pragma: no cover - the tests here use skip and abort
        raise AssertionError("no rollback expected")


class FakeWatchdog:
    def start(self):
        pass

    def stop(self):
        pass

    def watch(self, *args, **kwargs):
        import contextlib

        return contextlib.nullcontext()

    watch_background = watch


def _loop(tmp_path, losses=None, nonfinite="skip", steps=7, signal_at=None):
    from mpi4py import MPI

    cfg = Config()
    cfg.train.steps, cfg.train.global_batch, cfg.train.log_every, cfg.train.eval_every = steps, 4, 2, 0
    cfg.train.target_accuracy, cfg.checkpoint.save_final, cfg.guard.nonfinite = 0.0, True, nonfinite
    world = World(MPI.COMM_SELF, 0, 1, None, 0, 1, None, 0, 1)
    launched = iter(range(0, 10**6, 7))   # a stand-in GPU: 7 launches a step
    device = SimpleNamespace(describe=lambda: "cuda (stand-in)", dtype=np.dtype(np.float32), synchronize=lambda: None,
                             launches=lambda: next(launched))
    plan = SimpleNamespace(cfg=cfg, world=world, device=device, staging=SimpleNamespace(mode="host"), buckets=[1],
                           grid=SimpleNamespace(tensor=None, tensor_rank=0, scores=True), dp=world, tensor=None,
                           micro_batches=1, grad_slots=None, param_slots=None, pipeline=1, in_flight=1,
                           by_layers=False)
    model = SimpleNamespace(flat=SimpleNamespace(size=10), targets_per_row=1, flops_per_row=0)
    optimizer = SimpleNamespace(state=lambda: {}, state_size=0)
    sampler = SimpleNamespace(batch=4, steps_per_epoch=100, position=lambda step: (0, step))
    state = TrainingState(model, optimizer, sampler, np.random.default_rng(0))
    reader = SimpleNamespace(batch=lambda step: (np.zeros((4, 2), np.float32), np.zeros(4, np.int64)))
    data = SimpleNamespace(reader=reader, eval_shard=None, units="samples", describe="stand-in", info={})
    out, metrics = io.StringIO(), tmp_path / "metrics.jsonl"
    guard = NumericGuard(cfg.guard, Log(True, out))
    step = FakeStep(losses or {}, SimpleNamespace(lr=lambda s: 0.1), UpdatePolicy(guard), device)
    stop = SimpleNamespace(received=None)
    if signal_at is not None:  # the signal arrives during step signal_at
        run = step.run

        def signalled(at, x, y, votes=None):
            if at == signal_at:
                stop.received = "SIGUSR1"
            return run(at, x, y, votes)
        step.run = signalled
    ckpts = FakeCheckpoints(every=3)
    loop = RunLoop(plan, state, step, data, ckpts, guard, Reporting(Log(True, out), Metrics(str(metrics), True), Timers()),
                   Watching(FakeWatchdog(), Progress(False), stop))
    return loop, step, ckpts, state, out, metrics


def test_the_loop_steps_saves_when_due_and_writes_a_metrics_line_per_step(tmp_path):
    loop, step, ckpts, state, out, metrics = _loop(tmp_path)
    result = loop.run()
    assert result["steps"] == 7 == state.step and result["stopped_by"] is None and result["bad_steps"] == 0
    assert step.runs == step.updates == list(range(7))  # skip defers each update until the verdict
    assert ckpts.saved == [3, 6, 7]  # every 3 steps, and the final one
    lines = metrics.read_text().splitlines()
    assert len(lines) == 7 and '"step": 7' in lines[-1]
    assert all(json.loads(line)["launches"] == 7 for line in lines)   # the device's count, per step
    assert "done: 7 steps" in out.getvalue()


def test_the_loop_skips_a_bad_step_and_aborts_under_abort(tmp_path):
    loop, step, ckpts, state, out, _ = _loop(tmp_path, losses={2: float("nan")})
    result = loop.run()
    assert result["bad_steps"] == 1 and state.step == 7
    assert 2 in step.runs and 2 not in step.updates  # the step counts, its update is dropped
    loop, step, ckpts, state, out, _ = _loop(tmp_path, losses={2: float("nan")}, nonfinite="abort")
    with pytest.raises(TrainingDiverged):
        loop.run()
    assert state.step == 2 and ckpts.saved == []  # nothing of the bad step is saved


def test_a_stop_signal_saves_and_stops_at_the_step_boundary(tmp_path):
    loop, step, ckpts, state, out, _ = _loop(tmp_path, signal_at=4)
    result = loop.run()
    assert result["stopped_by"] == "SIGUSR1 received on 1 rank(s)" and state.step == 5
    assert ckpts.saved == [3, 5] and "stopping at step 5" in out.getvalue()

"""Activation recomputation (``model.recompute = "blocks"``): the same bits as keeping everything,
and the activation bytes the models report equal the arrays their layers really hold.

Recomputation re-runs each block's forward from its saved input with the same kernels in the
same order, so every gradient is compared with ``np.array_equal``, not a tolerance.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpctrain.device import CpuDevice, CudaDevice, cuda_status
from hpctrain.models.gpt import GPT
from hpctrain.models.mlp import MLP

SMALL = dict(vocab=256, context=16, n_layer=3, n_head=4, d_model=32)


def gpt(recompute, dtype="float64", device=None, seed=0, **shape):
    model = GPT(device or CpuDevice(dtype), **{**SMALL, **shape}, recompute=recompute)
    model.init(seed)
    return model


def batches(model, n, B=4, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, model.vocab, (B, model.context)), rng.integers(0, model.vocab, (B, model.context)))
            for _ in range(n)]


def grads_and_order(model, micro_batches):
    """Forward + backward of each micro-batch (the later ones accumulating): the losses, the
    gradient, and the order of the ready hooks of the last backward."""
    losses, order = [], []
    for i, (x, y) in enumerate(micro_batches):
        losses.append(model.forward(x, y))
        order.clear()
        model.backward(accumulate=i > 0, ready=order.append)
    return losses, model.flat.grad.copy(), list(order)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("micro", [1, 2])
def test_recompute_gives_the_same_gradient_bits(dtype, micro):
    none, blocks = gpt("none", dtype), gpt("blocks", dtype)
    data = batches(none, micro)
    l0, g0, o0 = grads_and_order(none, data)
    l1, g1, o1 = grads_and_order(blocks, data)
    assert l1 == l0
    assert np.array_equal(g1, g0)
    assert o1 == o0
    assert np.abs(g0).max() > 1e-3  # a real gradient, not zeros on both sides


@pytest.mark.parametrize("micro", [1, 2])
def test_every_block_but_the_top_one_recomputes(monkeypatch, micro):
    """The top block's backward comes right after its own forward: its activations are still in
    the shared arrays, so it re-runs nothing; every other block re-runs its forward once."""
    model = gpt("blocks")
    ran = []
    for block in model.blocks:
        def to_hidden(x, B, T, block=block, inner=block._to_hidden):
            ran.append(block.name)
            return inner(x, B, T)
        monkeypatch.setattr(block, "_to_hidden", to_hidden)
    for i, (x, y) in enumerate(batches(model, micro)):
        model.forward(x, y)
        ran.clear()
        model.backward(accumulate=i > 0)
        assert ran == [b.name for b in reversed(model.blocks[:-1])]


def test_an_evaluation_forward_between_steps_changes_nothing():
    """A forward of other windows (an evaluation chunk of another batch size) between two steps;
    the arrays are cached per shape, so the training step's own recompute is unaffected."""
    none, blocks = gpt("none"), gpt("blocks")
    (x, y), = batches(none, 1)
    (ex, ey), = batches(none, 1, B=3, seed=7)
    for model in (none, blocks):
        model.forward(x, y)
        model.backward()
        assert model.forward(ex, ey) == none.forward(ex, ey)
        model.forward(x, y)
        model.backward()
    assert np.array_equal(blocks.flat.grad, none.flat.grad)


def test_blocks_share_their_arrays_and_keep_their_outputs():
    model = gpt("blocks")
    (x, y), = batches(model, 1)
    model.forward(x, y)
    model.backward()
    first, second = model.blocks[:2]
    assert all(a.cache is b.cache for a, b in zip(first.layers(), second.layers()))
    outputs = [b._outputs[(4 * model.context, model.d_model)] for b in model.blocks]
    assert len({id(o) for o in outputs}) == model.n_layer  # each block's own: the next one's saved input
    shared = [a for cache in caches(model) for a in cache.values()]
    assert not any(np.shares_memory(o, a) for o in outputs for a in shared)


# ---- activation bytes: computed from shapes, checked against the arrays held ------------------
def caches(model) -> list:
    """The layers' distinct cache dicts (:attr:`Layer.cache`)."""
    layers = [model.embedding, *(layer for b in model.blocks for layer in b.layers()), model.ln_f, model.head,
              model.loss]
    return list({id(layer.cache): layer.cache for layer in layers if layer.cache is not None}.values())


def cached_arrays(model, activations=True):
    """The activations the layers hold in their caches and the blocks' outputs; or
    (``activations=False``) the gradient arrays (their keys start with "d")."""
    arrays = [a for cache in caches(model) for (key, _), a in cache.items() if key.startswith("d") != activations]
    if activations:
        arrays += [o for b in model.blocks for o in b._outputs.values()]
    return arrays


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_activation_bytes_equal_the_arrays_held_and_blocks_keep_less(dtype):
    B, held, grads = 5, {}, {}
    for recompute in ("none", "blocks"):
        model = gpt(recompute, dtype)
        (x, y), = batches(model, 1, B=B)
        model.forward(x, y)
        model.backward()
        held[recompute] = sum(a.nbytes for a in cached_arrays(model))
        grads[recompute] = sum(a.nbytes for a in cached_arrays(model, activations=False))
        assert model.activation_bytes(B) == held[recompute], recompute
    assert held["blocks"] < held["none"]
    assert grads["blocks"] < grads["none"]  # backward's gradient arrays are one shared set too


def test_mlp_activation_bytes_equal_the_arrays_held():
    model = MLP(CpuDevice("float32"), 8, [16, 12], 4, "gelu")
    model.init(0)
    rng = np.random.default_rng(0)
    model.forward(rng.normal(size=(7, 8)).astype(np.float32), rng.integers(0, 4, 7))
    model.backward()
    held = sum(a.nbytes for layer in [*model.layers, model.loss] for (key, _), a in (layer.cache or {}).items()
               if not key.startswith("d"))
    # z and the GELU output of each hidden layer, the logits (the loss writes its gradient over them)
    assert model.activation_bytes(7) == held == 4 * 7 * (16 + 16 + 12 + 12 + 4)


# ---- the trainer and the CUDA device ----------------------------------------------------------
def _train(text, recompute, out):
    from mpi4py import MPI

    from hpctrain.training.config import Config
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    cfg = Config()
    cfg.model.kind, cfg.model.recompute = "gpt", recompute
    cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.context = 2, 4, 32, 16
    cfg.data.train = text
    cfg.train.global_batch, cfg.train.grad_accum_steps, cfg.train.steps = 6, 2, 4
    cfg.train.dtype, cfg.train.device, cfg.train.log_every = "float32", "cpu", 10**6
    cfg.train.eval_every, cfg.train.eval_tokens = 2, 256
    cfg.train.metrics, cfg.train.trace = str(out / "metrics.jsonl"), str(out / "trace")
    cfg.optim.name, cfg.optim.lr, cfg.optim.warmup_steps = "adamw", 3e-3, 0
    cfg.checkpoint.every_minutes = 0
    trainer = Trainer(cfg.validate(), init_world(MPI.COMM_SELF), Log(False))
    result = trainer.run()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    spans = {e["name"] for e in json.load(open(next((out / "trace").iterdir())))["traceEvents"]}
    return trainer.model.flat.data.copy(), [(r["loss"], r.get("val_loss")) for r in rows if "loss" in r], \
        result["eval"], spans


def test_a_training_run_with_recompute_ends_with_the_same_bits(text_data, tmp_path):
    """Four steps of two micro-batches each, evaluations at steps 2 and 4, a trace: the same
    parameters, losses and validation scores with and without recomputation."""
    runs = {r: _train(text_data, r, tmp_path / r) for r in ("none", "blocks")}
    (p0, l0, e0, s0), (p1, l1, e1, s1) = runs["none"], runs["blocks"]
    assert np.array_equal(p1, p0)
    assert l1 == l0 and len(l0) == 4 and l0[1][1] is not None
    assert e1 == e0
    assert {"forward h.1", "backward h.0"} <= s1 and s1 == s0


@pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")
@pytest.mark.timeout(600)
def test_recompute_on_the_cuda_device_gives_the_same_bits():
    """One micro-batch of tiny shapes (under the simulator every CUDA thread runs interpreted Python;
    accumulation is the CPU tests' business). The CUDA attention keeps one log-sum-exp per row,
    and activation_bytes counts that."""
    shape = dict(vocab=13, context=5, n_layer=2, n_head=2, d_model=6)
    got = {}
    for recompute in ("none", "blocks"):
        dev = CudaDevice("float64")
        model = gpt(recompute, device=dev, seed=3, **shape)
        (x, y), = batches(model, 1, B=2, seed=5)
        loss = model.forward(dev.from_host(x, np.int64), dev.from_host(y, np.int64))
        model.backward()
        assert model.activation_bytes(2) == sum(a.nbytes for a in cached_arrays(model)), recompute
        got[recompute] = loss, dev.to_host(model.flat.grad).copy(), model.activation_bytes(2)
    (l0, g0, b0), (l1, g1, b1) = got["none"], got["blocks"]
    assert l1 == l0
    assert np.array_equal(g1, g0) and np.abs(g0).max() > 1e-3
    assert b1 < b0

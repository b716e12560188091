"""The whole GPT on the CPU (serial, no MPI): gradient against finite differences, causality,
the model interface the trainer relies on (ready hooks, accumulation, weight-decay runs), init."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.device import CpuDevice
from hpctrain.models.gpt import GPT
from hpctrain.optim.flat import decay_runs

TINY = dict(vocab=11, context=5, n_layer=2, n_head=2, d_model=8)


def tiny(dtype="float64", seed=0, **kw):
    model = GPT(CpuDevice(dtype), **{**TINY, **kw})
    model.init(seed)
    # GPT-2's init puts biases at 0 and LayerNorm weights at 1; random ones exercise every term
    rng = np.random.default_rng(seed + 1)
    for s in model.flat.slots:
        if len(s.shape) == 1:
            model.flat.view(model.flat.data, s.name)[...] = rng.normal(0.5, 0.3, s.shape)
    return model


def batch(model, B=3, T=None, seed=2):
    rng = np.random.default_rng(seed)
    T = T or model.context
    return rng.integers(0, model.vocab, (B, T)), rng.integers(0, model.vocab, (B, T))


def mean_loss(model, x, y) -> float:
    loss_sum, _ = model.forward(x, y)
    return loss_sum / y.size


def central_difference(model, x, y, i, eps=1e-6) -> float:
    """d(mean loss)/d(parameter i) by central differences; the parameter is restored.
    eps 1e-6 keeps the truncation error (~eps^2) and the rounding error (~1e-16 / eps) both
    near 1e-10, far below rtol 1e-6 of gradients of size ~1e-2."""
    data = model.flat.data
    keep = data[i]
    data[i] = keep + eps
    up = mean_loss(model, x, y)
    data[i] = keep - eps
    down = mean_loss(model, x, y)
    data[i] = keep
    return (up - down) / (2 * eps)


def test_gradient_matches_finite_differences():
    """Every parameter's gradient of the mean loss, against central differences in float64."""
    model = tiny()
    x, y = batch(model)
    mean_loss(model, x, y)
    model.backward()
    analytic = model.flat.grad.copy()
    numeric = np.array([central_difference(model, x, y, i) for i in range(model.flat.size)])
    for s in model.flat.slots:
        sl = slice(s.offset, s.offset + s.size)
        np.testing.assert_allclose(analytic[sl], numeric[sl], rtol=1e-6, atol=1e-9, err_msg=s.name)


@pytest.mark.parametrize("T", [1, 3])
def test_shorter_windows_and_single_rows(T):
    """B = 1 and T < context (sampling runs such windows): the gradient still matches a spot check."""
    model = tiny()
    x, y = batch(model, B=1, T=T)
    mean_loss(model, x, y)
    model.backward()
    analytic = model.flat.grad.copy()
    for i in np.random.default_rng(3).choice(model.flat.size, 40, replace=False):
        assert analytic[i] == pytest.approx(central_difference(model, x, y, i), rel=1e-6, abs=1e-9)


def test_causal_a_later_token_never_changes_earlier_predictions():
    model = tiny()
    x, _ = batch(model, B=2)
    before = model.logits(x).reshape(2, model.context, -1).copy()
    for t in range(model.context):
        changed = x.copy()
        changed[:, t] = (changed[:, t] + 1) % model.vocab
        after = model.logits(changed).reshape(2, model.context, -1)
        np.testing.assert_array_equal(after[:, :t], before[:, :t])
        assert not np.array_equal(after[:, t:], before[:, t:])


def test_ready_hook_names_every_parameter_once_in_bucket_order():
    """ready(name) comes once per parameter, ln_f first, the blocks top down, wte and wpe last,
    and only once its gradient is final (nothing written to it afterwards)."""
    model = tiny()
    x, y = batch(model)
    model.forward(x, y)
    seen, snapshots = [], {}

    def ready(name):
        seen.append(name)
        snapshots[name] = model.flat.view(model.flat.grad, name).copy()

    model.backward(ready=ready)
    names = [s.name for s in model.flat.slots]
    assert sorted(seen) == sorted(names)
    assert seen[:2] == ["ln_f.weight", "ln_f.bias"] and set(seen[-2:]) == {"wte", "wpe"}
    assert seen.index("h.1.ln_1.weight") < seen.index("h.0.ln_1.weight")
    for name in names:
        np.testing.assert_array_equal(model.flat.view(model.flat.grad, name), snapshots[name], err_msg=name)


def test_accumulate_adds_micro_batch_gradients():
    model = tiny()
    (x1, y1), (x2, y2) = batch(model, seed=4), batch(model, seed=5)
    grads = []
    for x, y in ((x1, y1), (x2, y2)):
        model.forward(x, y)
        model.backward()
        grads.append(model.flat.grad.copy())
    model.forward(x1, y1)
    model.backward()
    model.forward(x2, y2)
    model.backward(accumulate=True)
    np.testing.assert_allclose(model.flat.grad, grads[0] + grads[1], rtol=1e-12, atol=1e-15)


def test_weight_decay_skips_biases_and_layernorms_in_two_runs_per_block():
    model = tiny()
    assert model.no_decay == {s.name for s in model.flat.slots if s.name.endswith(".bias") or ".ln_" in s.name
                              or s.name.startswith("ln_f.")}
    decayed = {s.name for s in model.flat.slots} - model.no_decay
    assert decayed == {"wte", "wpe"} | {f"h.{i}.{m}.weight" for i in range(2)
                                       for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    runs = decay_runs(model.flat, model.no_decay)
    # wte, wpe and block 0's matrices | block 0's vectors | block 1's matrices | block 1's vectors and ln_f
    assert [(decays) for _, _, decays in runs] == [True, False] * TINY["n_layer"]
    assert runs[0][0] == 0 and runs[-1][1] == model.flat.size


def test_layer_units_are_contiguous_buckets_covering_the_model_once():
    """dist.bucket_split = layers: per block its attention's two matrices, c_fc, c_proj, its vectors;
    the tables each alone and ln_f; every bucket one unit, in reverse flat order."""
    from hpctrain.comm.buckets import plan_buckets

    model = tiny()
    units = model.layer_units
    assert units[:2] == [("wte",), ("wpe",)] and units[-1] == ("ln_f.weight", "ln_f.bias")
    assert units[2] == ("h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight") and len(units[5]) == 8
    buckets = plan_buckets(model.flat, 8, 25.0, 1.0, units=units)
    assert [tuple(reversed(b.slots)) for b in reversed(buckets)] == units
    assert [b.hi for b in buckets[1:]] == [b.lo for b in buckets[:-1]] and buckets[-1].lo == 0
    with pytest.raises(ValueError, match="lie together"):
        plan_buckets(model.flat, 8, 25.0, 1.0, units=[("wte", "ln_f.weight"), *units[1:-1], ("ln_f.bias",)])


def test_gpt2_init_statistics():
    model = GPT(CpuDevice("float64"), vocab=256, context=64, n_layer=4, n_head=4, d_model=64)
    model.init(0)
    view = lambda n: model.flat.view(model.flat.data, n)  # noqa: E731
    assert view("wte").std() == pytest.approx(0.02, rel=0.05)
    assert view("h.0.mlp.c_fc.weight").std() == pytest.approx(0.02, rel=0.05)
    assert view("h.0.mlp.c_proj.weight").std() == pytest.approx(0.02 / np.sqrt(8), rel=0.05)
    assert view("h.3.attn.c_proj.weight").std() == pytest.approx(0.02 / np.sqrt(8), rel=0.05)
    assert np.all(view("h.2.ln_1.weight") == 1) and np.all(view("ln_f.bias") == 0)
    assert np.all(view("h.1.attn.c_attn.bias") == 0)
    again = GPT(CpuDevice("float64"), vocab=256, context=64, n_layer=4, n_head=4, d_model=64)
    again.init(0)
    np.testing.assert_array_equal(again.flat.data, model.flat.data)


def test_float32_matches_float64():
    """The float32 model computes the same loss and gradient as float64 to float32 precision."""
    m64, m32 = tiny("float64"), tiny("float32")
    m32.flat.data[:] = m64.flat.data
    x, y = batch(m64)
    l64, l32 = mean_loss(m64, x, y), mean_loss(m32, x, y)
    assert l32 == pytest.approx(l64, rel=1e-5)
    m64.backward()
    m32.backward()
    np.testing.assert_allclose(m32.flat.grad, m64.flat.grad, rtol=1e-3, atol=1e-5)


def test_flops_per_row_counts_matrices_and_attention():
    model = tiny()
    C, T, L, V = 8, 5, 2, 11
    matrices = L * 12 * C * C + V * C
    assert model.flops_per_row == T * (6 * matrices + 12 * L * T * C)

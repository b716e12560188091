"""train.precision: the mixed device's rounding points, a GPT trained in bf16 against fp32, fp16's
loss scale, checkpoints across precisions, and the activation memory (the 16-bit conversions
themselves are tests/test_lowp.py's).

References are independent of the code under test: the float32 op on the same operands for the
mixed device's rounding points, and a float64 model for the gradients.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.device import CpuDevice, CudaDevice, cuda_status
from hpctrain.errors import ConfigError
from hpctrain.kernels import lowp
from hpctrain.models.gpt import GPT
from hpctrain.device import MixedDevice
from hpctrain.device.ops import FACTS, OPS
from hpctrain.precision import policy
from hpctrain.training.loss_scale import MIN_SCALE, LossScaler
from test_lowp import U_BF16, U_FP16

pytestmark = pytest.mark.timeout(300)


# ---- the policy and the mixed device ---------------------------------------------------------
def test_the_policy_names_the_dtypes_and_refuses_float64_masters():
    p = policy("bf16")
    assert (p.master, p.compute, p.accum, p.state, p.reduce) == (np.float32, lowp.BF16, np.float32, np.float32,
                                                                 np.float32)
    assert policy("fp32", "float64").compute == np.float64 and not policy("fp32").mixed
    # dist.reduce_dtype: the gradients' format on the wire, whatever the compute format
    assert policy("fp32", "float32", "bf16").reduce == lowp.BF16 and policy("bf16", "float32", "fp16").reduce == np.float16
    with pytest.raises(ConfigError, match="float32 master"):
        policy("fp16", "float64")
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.train.precision, cfg.train.dtype = "bf16", "float64"
    with pytest.raises(ConfigError, match="train.dtype = 'float32'"):
        cfg.validate()


def test_every_op_has_a_rounding_rule_on_both_devices():
    ops = set(vars(CpuDevice("float32").ops)) - set(FACTS)
    assert ops == set(OPS), ops ^ set(OPS)   # every op of the table has its row, with its rule
    master = CpuDevice("float32")
    master.ops = SimpleNamespace(**vars(master.ops), new_op=lambda x: x)   # the shared table untouched
    with pytest.raises(ValueError, match="new_op"):
        MixedDevice(master, policy("bf16"))


def rounded(a, fmt="bf16"):
    """float32 ``a`` rounded to the format and widened back (what a 16-bit array holds)."""
    low = lowp.narrow(np.ascontiguousarray(a, np.float32), np.empty(a.shape, lowp.FORMATS[fmt]))
    return lowp.widen(low, np.empty(a.shape, np.float32))


def low(a, fmt="bf16"):
    return lowp.narrow(np.ascontiguousarray(a, np.float32), np.empty(np.shape(a), lowp.FORMATS[fmt]))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_an_op_on_the_mixed_device_is_the_float32_op_on_its_rounded_operands_rounded_once(fmt):
    """The rounding points, bit for bit: a 16-bit operand is read exactly, the float32 kernel
    runs, a 16-bit output is rounded to nearest even; float32 operands (gradients) stay float32."""
    master, mixed = CpuDevice("float32"), MixedDevice(CpuDevice("float32"), policy(fmt))
    rng = np.random.default_rng(3)
    x, w, dz = rng.normal(size=(9, 7)), rng.normal(size=(7, 5)), rng.normal(size=(9, 5))
    z = mixed.ops.linear_forward(low(x, fmt), low(w, fmt), mixed.empty((9, 5)))
    ref = master.ops.linear_forward(rounded(x, fmt), rounded(w, fmt), np.empty((9, 5), np.float32))
    assert z.dtype == lowp.FORMATS[fmt] and np.array_equal(z.view(np.uint16), low(ref, fmt).view(np.uint16))
    dw, dx = np.full((7, 5), 0.5, np.float32), mixed.empty((9, 7))
    dw_ref = dw.copy()
    mixed.ops.linear_backward(low(dz, fmt), low(x, fmt), low(w, fmt), dx, dw, True)
    dx_ref = np.empty((9, 7), np.float32)
    master.ops.linear_backward(rounded(dz, fmt), rounded(x, fmt), rounded(w, fmt), dx_ref, dw_ref, True)
    assert np.array_equal(dw, dw_ref)                         # the float32 gradient, accumulated unrounded
    assert np.array_equal(dx.view(np.uint16), low(dx_ref, fmt).view(np.uint16))


def test_an_op_writing_over_its_input_and_returning_it_keeps_one_array():
    """The loss writes its gradient over the logits, and returns host scalars; an identity
    Linear's backward writes dz over dout: one float32 copy per array, the 16-bit array returned."""
    master, mixed = CpuDevice("float32"), MixedDevice(CpuDevice("float32"), policy("bf16"))
    rng = np.random.default_rng(4)
    logits, labels = low(rng.normal(size=(6, 11)) * 3), rng.integers(0, 11, 6)
    wide = rounded(lowp.widen(logits, np.empty((6, 11), np.float32)))
    loss, correct = mixed.ops.softmax_xent_fused(logits, labels, 0.25, logits)
    ref = master.ops.softmax_xent_fused(wide, labels, 0.25, wide)
    assert (loss, correct) == ref
    assert np.array_equal(logits, low(wide))
    dout, b = low(rng.normal(size=(6, 11))), np.zeros(11, np.float32)
    before = dout.copy()
    out = mixed.ops.bias_act_backward(dout, dout, dout, b, "identity")
    assert out is dout and np.array_equal(dout, before)
    np.testing.assert_allclose(b, lowp.widen(before, np.empty((6, 11), np.float32)).sum(0), rtol=1e-6)


def linear_bf16_error_bound():
    """A bf16 GEMM against float64 on the unrounded operands: each product's operands are rounded
    (relative error <= 2u + u^2, u = 2^-8), the K products of rounded operands are summed in
    float32 (<= K 2^-24 (1 + u)^2 of sum |x||w|), and the output is rounded once (<= u / (1 - u)
    of the rounded value):
    |z_bf16 - z| <= (2u + u^2 + K 2^-24 (1 + u)^2) (|x| |w|) + u / (1 - u) |z_bf16|."""
    rng = np.random.default_rng(5)
    K = 300
    x, w = rng.normal(size=(40, K)), rng.normal(size=(K, 30))
    mixed = MixedDevice(CpuDevice("float32"), policy("bf16"))
    z = lowp.widen(mixed.ops.linear_forward(low(x), low(w), mixed.empty((40, 30))), np.empty((40, 30), np.float32))
    u = U_BF16
    bound = (2 * u + u ** 2 + K * 2.0 ** -24 * (1 + u) ** 2) * (np.abs(x) @ np.abs(w)) + u / (1 - u) * np.abs(z)
    return np.abs(z - x @ w), bound


def test_a_bf16_gemm_is_within_its_derived_error_bound_of_float64():
    err, bound = linear_bf16_error_bound()
    assert (err <= bound).all()
    assert err.max() > 0.05 * bound.max()   # the rounding is real: not a float32 GEMM in disguise


SMALL = dict(vocab=61, context=12, n_layer=2, n_head=2, d_model=16)


def gpt_grads(device, tokens, targets, seed=0):
    model = GPT(device, **SMALL)
    model.init(seed)
    loss, _ = model.forward(tokens, targets)
    model.backward()
    return loss, np.array(model.flat.grad, np.float64), model


@pytest.mark.parametrize("fmt, within", [("bf16", 8 * U_BF16), ("fp16", 8 * U_FP16)])
def test_a_gpt_gradient_in_16_bits_is_near_float64s_and_rounded_more_than_float32s(fmt, within):
    """The whole gradient of a 2-block GPT (every op, forward and backward) against float64: its
    relative error (2-norm) within 8 unit roundoffs of the format (measured 0.74 for bf16, 0.67
    for fp16), and at least 10x float32's (measured 1.7e-7), so the 16-bit rounding points are
    really there."""
    rng = np.random.default_rng(6)
    tokens, targets = rng.integers(0, 61, (3, 12)), rng.integers(0, 61, (3, 12))
    l64, g64, _ = gpt_grads(CpuDevice("float64"), tokens, targets)
    l32, g32, _ = gpt_grads(CpuDevice("float32"), tokens, targets)
    l16, g16, model = gpt_grads(MixedDevice(CpuDevice("float32"), policy(fmt)), tokens, targets)
    assert model.flat.data.dtype == np.float32 and model.flat.grad.dtype == np.float32
    assert model.flat.compute.dtype == lowp.FORMATS[fmt]
    rel = lambda g: np.linalg.norm(g - g64) / np.linalg.norm(g64)  # noqa: E731
    assert rel(g16) <= within, rel(g16)
    assert rel(g16) > 10 * rel(g32), (rel(g16), rel(g32))
    assert abs(l16 - l64) <= within * abs(l64)


def test_the_compute_copy_follows_the_masters_at_every_forward():
    rng = np.random.default_rng(7)
    tokens, targets = rng.integers(0, 61, (2, 12)), rng.integers(0, 61, (2, 12))
    model = GPT(MixedDevice(CpuDevice("float32"), policy("bf16")), **SMALL)
    model.init(1)
    first = model.forward(tokens, targets)
    model.flat.data[:] *= 0.5            # an update, a checkpoint load, a rollback
    second = model.forward(tokens, targets)
    assert np.array_equal(model.flat.compute, low(model.flat.data))
    assert first != second


def test_bf16_halves_the_activations_but_the_residual_stream_and_counts_them_right():
    from test_recompute import cached_arrays

    B, held = 3, {}
    for fmt in ("fp32", "bf16"):
        dev = CpuDevice("float32") if fmt == "fp32" else MixedDevice(CpuDevice("float32"), policy(fmt))
        model = GPT(dev, **SMALL)
        model.init(0)
        rng = np.random.default_rng(0)
        model.forward(rng.integers(0, 61, (B, 12)), rng.integers(0, 61, (B, 12)))
        model.backward()
        held[fmt] = sum(a.nbytes for a in cached_arrays(model))
        assert model.activation_bytes(B) == held[fmt], fmt
    # float32 stays: the residual stream (the embedding's output, each block's mid-block sum and
    # output) and the LayerNorm means and rstds; the rest halves
    N, L, C = B * 12, SMALL["n_layer"], SMALL["d_model"]
    full = N * C * (1 + 2 * L) + 2 * N * (1 + 2 * L)
    assert held["bf16"] == (held["fp32"] - 4 * full) // 2 + 4 * full
    assert held["bf16"] < 0.65 * held["fp32"], held


@pytest.mark.skipif(cuda_status()[0] == 0, reason=f"numba.cuda unusable: {cuda_status()[1]}")
@pytest.mark.timeout(600)
def test_a_bf16_gpt_gradient_on_the_cuda_device_is_near_float64s():
    """The CUDA kernels with the conversions around them (a 1-block GPT of tiny shapes: under the
    simulator every CUDA thread runs interpreted Python): the same bound as the CPU's, 8 unit roundoffs."""
    shape = dict(vocab=13, context=5, n_layer=1, n_head=2, d_model=6)
    rng = np.random.default_rng(8)
    tokens, targets = rng.integers(0, 13, (2, 5)), rng.integers(0, 13, (2, 5))
    ref = GPT(CpuDevice("float64"), **shape)
    ref.init(2)
    l64, _ = ref.forward(tokens, targets)
    ref.backward()
    dev = CudaDevice("float32")
    model = GPT(MixedDevice(dev, policy("bf16")), **shape)
    model.init(2)
    loss, _ = model.forward(dev.from_host(tokens, np.int64), dev.from_host(targets, np.int64))
    model.backward()
    g = dev.to_host(model.flat.grad).astype(np.float64)
    assert dev.to_host(model.flat.compute).dtype == lowp.BF16
    rel = np.linalg.norm(g - ref.flat.grad) / np.linalg.norm(ref.flat.grad)
    assert rel <= 8 * U_BF16 and abs(loss - l64) <= 8 * U_BF16 * abs(l64), (rel, loss, l64)


def test_reduce_dtype_is_the_16_bit_wire_format_with_the_compressors_refusals():
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.dist.reduce_dtype = "bf16"
    assert cfg.validate().dist.compress == "bf16"
    assert cfg.validate().dist.compress == "bf16"   # validating again changes nothing
    cfg = Config()
    cfg.dist.reduce_dtype, cfg.dist.compress = "fp16", "topk(0.01)"
    with pytest.raises(ConfigError, match="already chooses what goes on the wire"):
        cfg.validate()
    cfg = Config()   # ZeRO refuses a compressor, and so the 16-bit wire format that is one
    cfg.dist.reduce_dtype, cfg.dist.zero = "bf16", 1
    with pytest.raises(ConfigError, match="bf16"):
        cfg.validate()


@pytest.mark.parametrize("sets", [{"compress": "topk(0.01)"}, {"reduce_dtype": "bf16"}])
def test_fp16_refuses_compression_whose_residuals_would_hold_the_loss_scale(sets):
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.train.precision = "fp16"
    for k, v in sets.items():
        setattr(cfg.dist, k, v)
    with pytest.raises(ConfigError, match="train.precision='fp16' with dist.compress"):
        cfg.validate()
    cfg.train.precision = "bf16"
    cfg.validate()


def test_the_computed_parameter_bytes_count_the_compute_copy():
    from hpctrain.observe import memory
    from hpctrain.optim import make_optimizer
    from hpctrain.training.config import OptimConfig

    for fmt, per in (("fp32", 4), ("bf16", 4 + 2)):
        dev = CpuDevice("float32")
        model = GPT(dev if fmt == "fp32" else MixedDevice(dev, policy(fmt)), **SMALL)
        opt = make_optimizer(dev, model.flat, OptimConfig(name="adamw"), model.no_decay)
        got = memory.computed(model, opt, dev, 2)
        assert got["params"] == per * model.flat.size and got["grads"] == 4 * model.flat.size, fmt
        assert got["optimizer"] == 2 * 4 * model.flat.size


def test_an_mlp_trains_in_bf16_as_in_fp32(small_data, tmp_path):
    from test_cli import train_in_process

    acc = {}
    for fmt in ("fp32", "bf16"):
        result = train_in_process("--config", "examples/mlp.toml", "--set", f"data.train={small_data[0]}",
                                  "--set", f"data.eval={small_data[1]}", "--set", "train.steps=150", "--set",
                                  "train.device=cpu", "--set", f"train.precision={fmt}", "--set",
                                  "train.target_accuracy=0", "--set", f"checkpoint.dir={tmp_path}/{fmt}",
                                  "--set", "checkpoint.save_final=false", "--set", "train.log_every=1000")
        acc[fmt] = result["eval"]["accuracy"]
    assert acc["fp32"] > 0.6 and abs(acc["bf16"] - acc["fp32"]) <= 0.02, acc


# ---- fp16's loss scale ---------------------------------------------------------------------
def test_the_loss_scale_halves_on_overflow_grows_after_its_window_and_leaves_the_rest_to_the_guard():
    s = LossScaler(8.0, window=3)
    assert s.judge(True, False) and s.scale == 4.0          # overflow: skipped, halved
    for _ in range(3):
        assert not s.judge(True, True)
        s.applied()
    assert s.scale == 8.0 and s.clean == 0                   # 3 clean steps: doubled
    assert not s.judge(False, False) and s.scale == 8.0     # a non-finite loss: the guard's
    low_scale = LossScaler(MIN_SCALE, window=3)
    assert not low_scale.judge(True, False)                  # nothing left to lower: the guard's
    s.load(LossScaler(2.0, 5).state())
    assert (s.scale, s.clean, s.overflows) == (2.0, 0, 0)
    with pytest.raises(ValueError):
        LossScaler(0.5)


def _train_gpt(text, tmp, *sets):
    from test_cli import train_in_process

    return train_in_process("--config", "examples/gpt.toml", "--set", f"data.train={text}",
                            "--set", "model.n_layer=2", "--set", "model.n_head=2", "--set", "model.d_model=32",
                            "--set", "model.context=32", "--set", "train.device=cpu", "--set",
                            "train.global_batch=16", "--set", "train.eval_tokens=4096", "--set",
                            "train.target_bpb_vs_bigram=0", "--set", "train.log_every=1000", "--set",
                            "checkpoint.every_minutes=0", "--set", f"checkpoint.dir={tmp}/ckpt", "--set",
                            f"train.metrics={tmp}/metrics.jsonl", "--set", "optim.warmup_steps=10", *sets)


def _records(tmp):
    with open(os.path.join(tmp, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_an_overflowing_fp16_step_is_skipped_and_halves_the_scale(text_data, tmp_path):
    """A scale of 2^30 overflows fp16's activation gradients: those steps are skipped (no update:
    the optimizer's step count is the applied steps), the scale halves each time until a step
    fits, then grows after its window; none of it is a bad step for the guard."""
    result = _train_gpt(text_data, tmp_path, "--set", "train.precision=fp16", "--set", "train.steps=24",
                        "--set", "train.loss_scale=1073741824", "--set", "train.loss_scale_window=4",
                        "--set", "checkpoint.save_final=false", "--set", "guard.nonfinite=abort",
                        "--set", "checkpoint.every_steps=12")
    recs = _records(tmp_path)
    over = [r for r in recs if r["overflow"]]
    assert over and recs[0]["overflow"] and recs[0]["loss_scale"] == 2.0 ** 30 and recs[0]["skipped"]
    for a, b in zip(recs, recs[1:]):
        if a["overflow"]:
            assert b["loss_scale"] == a["loss_scale"] / 2
    assert any(b["loss_scale"] == 2 * a["loss_scale"] for a, b in zip(recs, recs[1:]))  # grown after a window
    assert result["bad_steps"] == 0 and all(r["bad_steps"] == 0 for r in recs)
    assert np.isfinite(result["eval"]["loss"])
    import h5py   # an overflowing step was not applied: the optimizer counted only the others

    with h5py.File(tmp_path / "ckpt" / "ckpt-00000012.h5", "r") as f:
        assert int(f["/optim/step_count"][0]) == sum(not r["overflow"] for r in recs[:12]) < 12
    # the scale is in the checkpoint: a run resumed at step 12 continues with the saved scale
    resumed = tmp_path / "resumed"
    _train_gpt(text_data, resumed, "--set", "train.precision=fp16", "--set", "train.steps=14", "--set",
               "train.loss_scale=1073741824", "--set", "train.loss_scale_window=4", "--resume",
               str(tmp_path / "ckpt" / "ckpt-00000012.h5"))
    again = _records(resumed)
    assert [r["step"] for r in again] == [13, 14]
    assert [r["loss_scale"] for r in again] == [r["loss_scale"] for r in recs[12:14]] != [2.0 ** 30] * 2


def test_bf16_trains_like_fp32_and_checkpoints_cross_precisions(text_data, tmp_path):
    """The same GPT, data and steps in fp32 and bf16: the final validation loss within 2 %. The
    bf16 run's checkpoint holds float32 masters; an fp32 run resumes from it, and a bf16 run
    resumed from its middle ends with the uninterrupted run's parameters bit for bit."""
    import h5py

    steps = ("--set", "train.steps=120", "--set", "checkpoint.every_steps=60")
    runs = {}
    for fmt in ("fp32", "bf16"):
        tmp = str(tmp_path / fmt)
        runs[fmt] = _train_gpt(text_data, tmp, "--set", f"train.precision={fmt}", *steps)["eval"]["loss"]
    assert abs(runs["bf16"] - runs["fp32"]) <= 0.02 * runs["fp32"], runs
    assert runs["bf16"] != runs["fp32"]
    final = str(tmp_path / "bf16" / "ckpt" / "ckpt-00000120.h5")
    with h5py.File(final, "r") as f:
        assert f["/model/wte"].dtype == np.float32
        end = {k: f[f"/model/{k}"][...] for k in ("wte", "h/1/mlp/c_fc/weight")}
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed + "/ckpt")
    os.link(str(tmp_path / "bf16" / "ckpt" / "ckpt-00000060.h5"), resumed + "/ckpt/ckpt-00000060.h5")
    _train_gpt(text_data, resumed, "--set", "train.precision=bf16", *steps, "--resume", "auto")
    with h5py.File(resumed + "/ckpt/ckpt-00000120.h5", "r") as f:
        for k, v in end.items():
            assert np.array_equal(f[f"/model/{k}"][...], v), k
    into_fp32 = _train_gpt(text_data, str(tmp_path / "fp32-from-bf16"), "--set", "train.steps=125", "--resume",
                           final)
    assert into_fp32["steps"] == 125 and abs(into_fp32["eval"]["loss"] - runs["bf16"]) < 0.05 * runs["bf16"]

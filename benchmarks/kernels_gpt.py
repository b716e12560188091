"""The GPT's rows of benchmarks/kernels.py: layernorm, attention (forward, backward) and a whole
GPT step, each validated against the CPU twin before it is timed.

Yardsticks measured in the same run, on the same device stream:
  - layernorm: copy bandwidth (bytes of x, out, mean, rstd; dout, x, dx and the
    parameter gradients backward), target >= 0.8x;
  - attention, the flash kernels and (where cuBLAS runs) the GEMM path (model.attention = gemm),
    each against PyTorch's ``scaled_dot_product_attention(is_causal=True)`` on the same
    q, k, v (torch tensors over the same numbers, on the device's stream), target for
    forward >= 0.5x at T = 1024; work counted as 4 B NH T^2 hs FLOPs forward (QK^T and
    PV, the causal half not subtracted) and 2.5x that backward, as FlashAttention counts;
  - GPT step (forward, backward, AdamW; 6 layers, d 384, 6 heads, context 1024, 8
    windows): PyTorch eager on the same model shape (benchmarks/peers/gpt2_torch.py),
    tokens/s, target >= 0.5x with the device's GEMM (train.gemm; cuBLAS where CuPy runs).
Without PyTorch (or on the simulator) those ceilings are n/a.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from hpctrain.device import CPU_OPS, CpuDevice
from hpctrain.kernels import adamw
from hpctrain.models.gpt import GPT

ATTN_TARGET, STEP_TARGET = 0.5, 0.5


def _f64(a):
    return np.array(a, np.float64)


def validate(dev, small, rng, check, step_dev):
    """{check name: passed} for the GPT's rows (``check`` is kernels.py's); the whole step on
    ``step_dev`` (``dev`` with the GEMMs chosen by kernels.py's --gemm, the same stream).

    Bounds as kernels.py's: generous multiples of each result's accumulated rounding (sum
    lengths times u times the terms' size), so FMA contraction, summation order and the
    simulator's float rules pass, while a wrong index or formula misses by orders of magnitude.
    """
    ops, dt, u = dev.ops, dev.dtype, float(np.finfo(dev.dtype).eps) / 2
    up, host = dev.from_host, dev.to_host
    ok = {}
    N, C = (20, 40) if small else (2048, 768)
    x, w, b, dout = (rng.standard_normal(s).astype(dt) for s in ((N, C), (C,), (C,), (N, C)))
    out, mean, rstd = np.empty((N, C)), np.empty(N), np.empty(N)
    CPU_OPS.layernorm_forward(_f64(x), _f64(w), _f64(b), out, mean, rstd)
    OUT, MEAN, RSTD = dev.empty((N, C)), dev.empty(N), dev.empty(N)
    ops.layernorm_forward(up(x), up(w), up(b), OUT, MEAN, RSTD)
    # statistics in float64, one rounding on store, then a few float32 roundings per element
    ok["layernorm_forward"] = check("layernorm_forward out", host(OUT), out, 16 * u * (np.abs(out) + np.abs(b) + 1))
    dx, dw, db = np.empty((N, C)), np.empty(C), np.empty(C)
    CPU_OPS.layernorm_backward(_f64(dout), _f64(x), _f64(w), _f64(host(MEAN)), _f64(host(RSTD)), dx, dw, db)
    DX, DW, DB = dev.empty((N, C)), dev.empty(C), dev.empty(C)
    ops.layernorm_backward(up(dout), up(x), up(w), MEAN, RSTD, DX, DW, DB)
    terms = np.abs(_f64(dout)).sum(0) * (1 + np.abs((_f64(x) - _f64(host(MEAN))[:, None]) * _f64(host(RSTD))[:, None]).max())
    ok["layernorm_backward"] = all([
        check("layernorm_backward dx", host(DX), dx, 64 * u * (np.abs(dx).max() + np.abs(dout).max() * np.abs(w).max())),
        check("layernorm_backward dweight", host(DW), dw, 2 * (N + 8) * u * terms),
        check("layernorm_backward dbias", host(DB), db, 2 * (N + 2) * u * np.abs(_f64(dout)).sum(0))])
    B, NH, T, hs = (2, 2, 9, 8) if small else (2, 4, 256, 64)
    qkv = (rng.standard_normal((B, T, 3 * NH * hs)) * 0.5).astype(dt)
    y, probs = np.empty((B, T, NH * hs)), np.empty((B, NH, T, T))
    CPU_OPS.attention_forward(_f64(qkv), NH, y, probs)
    saved, work = ops.attention_state_shapes(B, NH, T)
    dy = rng.standard_normal((B, T, NH * hs)).astype(dt)
    dqkv = np.empty((B, T, 3 * NH * hs))
    CPU_OPS.attention_backward(_f64(dy), _f64(qkv), y, probs, NH, dqkv)
    # each output is a P-weighted mean of T values, each score a length-hs dot product
    bound = 8 * (T + hs) * u * np.abs(qkv).max() * (1 + np.abs(qkv).max() ** 2 * hs)
    for suffix, attn in attention_paths(dev, step_dev):
        Y, S, DQKV = dev.empty((B, T, NH * hs)), dev.empty(saved), dev.empty((B, T, 3 * NH * hs))
        attn.forward(up(qkv), NH, Y, S)
        ok["attention_forward" + suffix] = check("attention_forward" + suffix + " out", host(Y), y, bound)
        attn.backward(up(dy), up(qkv), Y, S, NH, DQKV, dev.empty(work))
        ok["attention_backward" + suffix] = check("attention_backward" + suffix + " dqkv", host(DQKV), dqkv,
                                                  bound * np.abs(dy).max() * 4 * np.sqrt(T))
    ok["gpt_step"] = _validate_step(step_dev, rng, check, small)
    return ok


def attention_paths(dev, step_dev):
    """[(row suffix, attention ops)]: the flash kernels, and the GEMM path (model.attention = gemm) where
    its GEMMs can run: cuBLAS when ``step_dev``'s GEMMs are cuBLAS's, NumPy on the simulator."""
    from hpctrain.device import simulated
    from hpctrain.kernels.attention import ChosenAttention
    from hpctrain.kernels.support.batched_gemm import CublasBatchedGemm, HostBatchedGemm

    paths = [("", ChosenAttention("flash", dev.stream, dev.scratch))]
    gemms = (CublasBatchedGemm(dev.stream, dev.gpu) if step_dev.gemm == "cublas" else
             HostBatchedGemm() if simulated() else None)
    if gemms is not None:
        paths.append((" (gemm)", ChosenAttention("gemm", dev.stream, dev.scratch, gemms)))
    return paths


def _step_model(dev, vocab, context, layers, heads, d):
    model = GPT(dev, vocab, context, layers, heads, d)
    model.init(1)
    return model


def _validate_step(dev, rng, check, small):
    """One forward + backward of a small GPT against the CPU twin in float64 on the same tokens:
    the loss and every gradient within float32 accumulated rounding (1e-3 of the largest)."""
    B, T, layers, d_model = (2, 8, 1, 8) if small else (2, 16, 2, 16)
    tokens, targets = rng.integers(0, 64, (B, T)), rng.integers(0, 64, (B, T))
    got = []
    for d in (dev, CpuDevice("float64")):
        model = _step_model(d, 64, T, layers, 2, d_model)
        loss, _ = model.forward(d.from_host(tokens, np.int64), d.from_host(targets, np.int64))
        model.backward()
        got.append((loss, d.to_host(model.flat.grad).astype(np.float64)))
    (l1, g1), (l0, g0) = got
    return all([check("gpt_step loss", l1, l0, 1e-4 * abs(l0)),
                check("gpt_step gradients", g1, g0, 1e-3 * np.abs(g0).max())])


def _torch(dev):
    """(torch, a context manager running torch on the device's stream), or (None, None)."""
    from hpctrain.device import simulated

    if simulated():
        return None, None
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    return torch, lambda: torch.cuda.stream(torch.cuda.ExternalStream(int(dev.stream)))


def cases(dev, small, rng, step_dev):
    """Rows as kernels.py's ``cases``: (kernel, shape, unit, work, fn, (ceiling fn, name) or None, target);
    the whole step runs on ``step_dev`` (see :func:`validate`)."""
    s, ops = dev.dtype.itemsize, dev.ops
    torch, on_stream = _torch(dev)

    def arr(*shape):
        return dev.from_host((rng.standard_normal(shape) * 0.5).astype(dev.dtype))

    rows = []
    N, C = (16, 32) if small else (8192, 768)
    x, w, b, dout = arr(N, C), arr(C), arr(C), arr(N, C)
    out, mean, rstd, dx, dw, db = dev.empty((N, C)), dev.empty(N), dev.empty(N), dev.empty((N, C)), dev.empty(C), \
        dev.empty(C)
    rows += [("layernorm_forward", f"{N}x{C}", "GB/s", 2 * N * C * s + 2 * N * s + 2 * C * s,
              lambda: ops.layernorm_forward(x, w, b, out, mean, rstd), None, 0.8),
             ("layernorm_backward", f"{N}x{C}", "GB/s", 3 * N * C * s + 2 * N * s + 3 * C * s,
              lambda: ops.layernorm_backward(dout, x, w, mean, rstd, dx, dw, db), None, 0.8)]
    B, NH, T, hs = (1, 2, 16, 8) if small else (4, 12, 1024, 64)
    qkv, y = arr(B, T, 3 * NH * hs), dev.empty((B, T, NH * hs))
    saved, work = ops.attention_state_shapes(B, NH, T)
    lse, wk, dy, dqkv = dev.empty(saved), dev.empty(work), arr(B, T, NH * hs), dev.empty((B, T, 3 * NH * hs))
    flops = 4 * B * NH * T * T * hs
    sdpa_fwd = sdpa_bwd = None
    if torch is not None:
        q, k, v = (torch.as_tensor(qkv, device="cuda").view(B, T, 3, NH, hs)[:, :, i].transpose(1, 2)
                   .contiguous().requires_grad_(True) for i in range(3))
        g = torch.as_tensor(dy, device="cuda").view(B, T, NH, hs).transpose(1, 2).contiguous()
        F = torch.nn.functional

        def fwd():
            with on_stream(), torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def bwd():
            with on_stream():
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        sdpa_fwd, sdpa_bwd = (fwd, "PyTorch SDPA"), (bwd, "PyTorch SDPA fwd+bwd")
    for suffix, attn in attention_paths(dev, step_dev):
        rows += [("attention_forward" + suffix, f"B{B} NH{NH} T{T} hs{hs}", "GFLOP/s", flops,
                  lambda a=attn: a.forward(qkv, NH, y, lse), sdpa_fwd, ATTN_TARGET),
                 # timed as forward + backward against SDPA's forward + backward (autograd needs the forward)
                 ("attention_backward (+forward)" + suffix, f"B{B} NH{NH} T{T} hs{hs}", "GFLOP/s", 3.5 * flops,
                  lambda a=attn: (a.forward(qkv, NH, y, lse), a.backward(dy, qkv, y, lse, NH, dqkv, wk)),
                  sdpa_bwd, None)]
    rows.append(_step_row(step_dev, small, rng, torch, on_stream))
    return rows


def _step_row(dev, small, rng, torch, on_stream):
    vocab, context, layers, heads, d, batch = (64, 8, 1, 2, 8, 1) if small else (256, 1024, 6, 6, 384, 8)
    model = _step_model(dev, vocab, context, layers, heads, d)
    tokens = dev.from_host(rng.integers(0, vocab, (batch, context)), np.int64)
    targets = dev.from_host(rng.integers(0, vocab, (batch, context)), np.int64)
    m, v = dev.zeros(model.flat.size), dev.zeros(model.flat.size)
    hyper = dev.from_host(adamw.hyperparameters(dev.dtype, 1, 1e-4, 0.9, 0.95, 1e-8, 0.1))

    def step():
        model.forward(tokens, targets)   # copies the loss to the host, as a training step does
        model.backward()
        dev.ops.adamw_update(model.flat.data, model.flat.grad, m, v, hyper)
    ref = None
    if torch is not None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
        import gpt2_torch

        net = gpt2_torch.GPT(vocab, context, layers, heads, d, torch.float32 if dev.dtype == np.float32 else
                             torch.float64, gpt2_torch.OpClock(False)).cuda()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        x = torch.as_tensor(tokens, device="cuda")
        y = torch.as_tensor(targets, device="cuda")

        def torch_step():
            with on_stream():
                loss = gpt2_torch.cross_entropy(net(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss.item()                # the loss to the host, as hpctrain's step
        ref = (torch_step, "PyTorch eager")
    return (f"gpt_step ({dev.gemm} GEMM)", f"{layers}x d{d} T{context} B{batch}", "tokens/s", batch * context,
            step, ref, STEP_TARGET)

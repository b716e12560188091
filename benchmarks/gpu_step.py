"""A GPT training step on one GPU: hpctrain against PyTorch eager, the same model, weights,
batches and optimizer, in float32 and in bf16 mixed precision.

    python benchmarks/gpu_step.py                                  # both shapes; runs/bench/gpu_step.json
    python benchmarks/gpu_step.py --shapes gpt2-small --steps 20 --json OUT.json
    python benchmarks/gpu_step.py --precisions bf16                # the bf16 rows only
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/gpu_step.py --simulate   # the plumbing, a tiny GPT, no GPU

Shapes:
  example     examples/gpt.toml's GPT: 4 layers, d 128, 4 heads, context 128, vocabulary 256,
              32 windows a step (4,096 tokens)
  gpt2-small  GPT-2 small: 12 layers, d 768, 12 heads, context 1024, vocabulary 50,257,
              8 windows a step (8,192 tokens)
  tiny        (--simulate) 1 layer, d 4, 2 heads, context 4, vocabulary 16, 4 windows (16 tokens):
              each simulated thread is interpreted Python, so every GEMM is one ragged 64 x 64
              tile and one K slab, and every activation fits one block of a 1-D kernel

For each shape both sides start from hpctrain's initial weights (``GPT.init``, copied into
benchmarks/peers/gpt2_torch.py's model, which uses ``scaled_dot_product_attention``), train on
the same random token batches with AdamW (lr 3e-4 constant, betas (0.9, 0.95), weight decay 0.1
on matrices and embeddings only, hpctrain's rule), and:

1. validate: the first --validate (10) steps' losses agree within --loss-rtol (1e-4, relative);
   --simulate: against hpctrain's float64 CPU twin instead (PyTorch does not run on the
   simulator). A shape that fails is not timed; the exit code is then 1.
2. time: --warmup steps, then --steps steps (each ends with its loss on the host, as a
   training step does): ms per step, tokens/s, and hpctrain / PyTorch.
3. per-op split: --op-steps (3) more steps with every op synchronised and timed (hpctrain's
   ``train.op_times`` wrapper, gpt2_torch.OpClock), ms per step by family.
4. launches per step: hpctrain's launch calls (numba kernels, cuBLAS calls and graph replays, as
   the trainer's ``launches`` metric counts them) over one step, and both sides' CUDA kernels over one step by PyTorch's profiler (which
   sees every kernel in the process; run after the shape's timing); the host's cost of one
   launch (benchmarks/launch_cost.py: through the op table, a configured kernel, the compiled
   launch, a PyTorch op).
5. MFU: the model's FLOPs per step (``GPT.flops_per_row``, nanoGPT's count) per second, over the
   float32 GEMM peak measured in this run (an 8192^3 cuBLAS SGEMM through CuPy, best of 3), with
   the card's datasheet dense FP32 peak beside it where the card is known.

Precisions (``--precisions``, default fp32 bf16): fp32 is float32 on both sides. bf16 is
hpctrain's ``train.precision = "bf16"`` (float32 masters and AdamW, 16-bit activations and
parameter copy, float32 inside each op) against PyTorch under ``torch.autocast("cuda",
dtype=torch.bfloat16)`` (float32 parameters and AdamW, bf16 GEMMs on tensor cores); validated
within --loss-rtol-16 (2e-2; the two round at different points) and, on the simulator, against the
float64 CPU twin. Each row also gives the activation bytes hpctrain's model keeps per step
(computed) and PyTorch's peak allocated memory over one step.

hpctrain's step replays forward and backward, and AdamW's update, as CUDA graphs where the device can capture
(``--graphs auto``, as ``train.cuda_graphs``; the graphs column says which, and why not); the
per-op split runs eagerly. TF32 is off on both sides (PyTorch's default for matmuls, CuPy's
default). Prints a Markdown table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks", "peers"))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import launch_cost  # noqa: E402  (benchmarks/launch_cost.py)

# name: (n_layer, d_model, n_head, context, vocab, windows per step)
SHAPES = {"example": (4, 128, 4, 128, 256, 32), "gpt2-small": (12, 768, 12, 1024, 50257, 8),
          "tiny": (1, 4, 2, 4, 16, 4)}
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
# datasheet dense FP32 (no tensor cores), TFLOP/s, by a fragment of nvidia-smi's name
FP32_PEAK_TFLOPS = (("H100 PCIe", 51.0), ("H100 NVL", 60.0), ("H100", 67.0), ("H200 NVL", 60.0), ("H200", 67.0),
                    ("A100", 19.5))


def optim_config():
    from hpctrain.training.config import OptimConfig

    return OptimConfig(name="adamw", lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)


class Hpctrain:
    """hpctrain's GPT and AdamW on ``dev``, a training step as the trainer's: the batch copied into
    the step's input buffers, forward and backward (a CUDA graph's replay with ``graphs``, as
    ``train.cuda_graphs``), AdamW, and the loss statistics kept on the device and read once.
    ``step(x, y)`` -> the step's mean loss (a float)."""

    def __init__(self, dev, shape, seed=1, graphs=False, precision="fp32"):
        from hpctrain.models.gpt import GPT
        from hpctrain.optim import make_optimizer
        from hpctrain.device import on_device
        from hpctrain.precision import policy
        from hpctrain.training.cuda_graphs import StepGraphs

        layers, d, heads, context, vocab, rows = shape
        self.dev = dev
        # train.precision: the model on a MixedDevice over dev (bf16), AdamW on dev's float32 masters
        self.model_dev = on_device(dev, policy(precision, str(dev.dtype)))
        self.model = GPT(self.model_dev, vocab, context, layers, heads, d)
        self.model.init(seed)
        self.opt = make_optimizer(dev, self.model.flat, optim_config(), self.model.no_decay)
        self.t = 0
        self.x, self.y = dev.empty((rows, context), np.int64), dev.empty((rows, context), np.int64)
        self.totals = dev.zeros((2,), np.float64)
        self.graphs = StepGraphs(dev, self.model) if graphs else None

    def step(self, x, y):
        if hasattr(self.dev, "stream"):  # device to device, on the stream (the trainer uploads from the host)
            self.x.copy_to_device(x, stream=self.dev.stream)
            self.y.copy_to_device(y, stream=self.dev.stream)
        else:
            self.x[...], self.y[...] = x, y
        if self.graphs is not None:   # forward and backward, then AdamW: two replays
            self.graphs.run(self.x, self.y, self.totals, False, False)
            self.opt.begin_step(self.t, LR)
            self.graphs.update(self.opt, 0, self.model.flat.size)
        else:
            self.model.forward(self.x, self.y, totals=self.totals)
            self.model.backward()
            self.opt.step(LR, self.t)
        self.t += 1
        return float(self.dev.to_host(self.totals)[0]) / y.size

    def weights(self) -> dict:
        """name -> host array (hpctrain's layout: Linear weights (in, out))."""
        flat = self.dev.to_host(self.model.flat.data)
        return {s.name: flat[s.offset:s.offset + s.size].reshape(s.shape) for s in self.model.flat.slots}


class Torch:
    """gpt2_torch's GPT with ``weights`` and torch AdamW (hpctrain's decay rule), on cuda."""

    def __init__(self, torch, shape, weights, no_decay, clock=False, precision="fp32"):
        import common
        import gpt2_torch

        layers, d, heads, context, vocab, _ = shape
        self.torch = torch
        self.clock = gpt2_torch.OpClock(clock, torch.cuda.synchronize if clock else None)
        self.net = gpt2_torch.GPT(vocab, context, layers, heads, d, torch.float32, self.clock).cuda()
        with torch.no_grad():
            for name, p in self.net.named_parameters():
                w = weights[name]
                linear = p.dim() == 2 and name.endswith(".weight")   # (in, out) -> torch's (out, in)
                p.copy_(torch.from_numpy(np.ascontiguousarray(w.T if linear else w)))
        self.opt = common.make_optimizer(torch, self.net, no_decay, optim_config())
        self.cross_entropy = gpt2_torch.cross_entropy
        # bf16: autocast's mixed precision (float32 parameters and optimizer, bf16 GEMMs), as users run it
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else
                         __import__("contextlib").nullcontext())

    def step(self, x, y):
        clocked = self.clock.enabled
        with self.autocast:
            loss = self.clock.op("loss", self.cross_entropy, self.net(x), y)   # timed as the peer's loss
        if clocked:
            self.clock.start_backward()
        loss.backward()
        if clocked:
            self.torch.cuda.synchronize()
            self.backward_end = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = loss.item()
        if clocked:
            self.optimizer_s = time.perf_counter() - self.backward_end
        return value


def batches(shape, n, seed=0):
    _, _, _, context, vocab, rows = shape
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (rows, context)), rng.integers(0, vocab, (rows, context))) for _ in range(n)]


def timed(step, data, warmup, steps, sync):
    """Seconds per step over ``steps`` steps after ``warmup`` (data cycled)."""
    for i in range(warmup):
        step(*data[i % len(data)])
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
    sync()
    return (time.perf_counter() - t0) / steps


def count_launches(fn) -> int:
    """The host's launches while ``fn`` runs, as the trainer's metrics count them
    (``hpctrain.kernels.support.cuda_support.launches``): numba kernels, cuBLAS calls (a GEMM that
    accumulates is two: the GEMM and CuPy's add into its output) and CUDA graph replays."""
    from hpctrain.kernels.support import cuda_support

    before = cuda_support.launches()
    fn()
    return cuda_support.launches() - before


def torch_kernels(torch, fn) -> int | None:
    """CUDA kernels PyTorch launched while ``fn`` ran, copies and memsets not counted (its profiler;
    None where it cannot run or saw nothing)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                and not e.name.startswith(("Memcpy", "Memset")))
    except Exception:  # noqa: BLE001 -- CUPTI missing or refused: the column says n/a
        return None
    return n or None


def cublas_peak_flops(n=8192, repeats=3) -> float | None:
    """FLOP/s of an n^3 float32 SGEMM through CuPy's cuBLAS (best of ``repeats``); None without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    a = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    b = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    c = a @ b
    best = float("inf")
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        cupy.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return 2.0 * n ** 3 / best


def card_peak_tflops(name: str) -> float | None:
    return next((peak for fragment, peak in FP32_PEAK_TFLOPS if fragment in name), None)


def measure(shape_name, args, dev, torch, precision="fp32"):
    """One shape's row in one precision (a dict)."""
    from hpctrain.device import CpuDevice

    shape = SHAPES[shape_name]
    layers, d, heads, context, vocab, rows = shape
    data = batches(shape, max(args.validate, 4))
    graphs = args.graphs_on and precision == "fp32"   # a 16-bit step runs eagerly (train.cuda_graphs)
    ours = Hpctrain(dev, shape, graphs=graphs, precision=precision)
    up = [(dev.from_host(x, np.int64), dev.from_host(y, np.int64)) for x, y in data]
    row = {"shape": shape_name, "n_layer": layers, "d_model": d, "n_head": heads, "context": context,
           "vocab": vocab, "windows": rows, "tokens_per_step": rows * context, "dtype": "float32",
           "precision": precision, "gemm": dev.gemm,
           "attention": dev.ops.attention_forward.__self__.which(context, d // heads),
           "graphs": "eager", "parameters": int(ours.model.flat.size),
           "activation_bytes": int(ours.model.activation_bytes(rows))}
    if torch is not None:
        peer = Torch(torch, shape, ours.weights(), ours.model.no_decay, precision=precision)
        tup = [(torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda")) for x, y in data]
        against = "PyTorch eager" + (" (autocast bf16)" if precision == "bf16" else "")
        torch.cuda.reset_peak_memory_stats()
        reference = [peer.step(*b) for b in tup[:args.validate]]
        row["torch_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    else:  # the simulator: hpctrain's float64 CPU twin from the same weights
        twin = Hpctrain(CpuDevice("float64"), shape)
        reference, against = [twin.step(x, y) for x, y in data[:args.validate]], "hpctrain float64 CPU"
    got = [ours.step(*b) for b in up[:args.validate]]
    rel = [abs(a - b) / abs(b) for a, b in zip(got, reference)]
    tolerance = args.loss_rtol if precision == "fp32" else args.loss_rtol_16
    row.update(validated_against=against, losses=got, reference_losses=reference, loss_rel_diff=max(rel),
               loss_rtol=tolerance, valid=max(rel) <= tolerance)
    if ours.graphs is not None:   # captured at step 2, replayed and checked at 3, replayed after (or failed)
        row["graphs"] = f"eager (capture failed: {ours.graphs.failed})" if ours.graphs.failed else "graphs"
    elif args.graphs_why or precision != "fp32":
        row["graphs"] = f"eager ({args.graphs_why or 'train.precision = ' + precision + ' runs eagerly'})"
    if not row["valid"]:
        return row
    s = timed(ours.step, up, args.warmup, args.steps, dev.synchronize)
    row.update(ms_per_step=s * 1e3, tokens_per_s=rows * context / s)
    flops = ours.model.flops_per_row * rows / s
    row["model_tflops"] = flops / 1e12
    if torch is not None:
        ts = timed(peer.step, tup, args.warmup, args.steps, torch.cuda.synchronize)
        row.update(torch_ms_per_step=ts * 1e3, torch_tokens_per_s=rows * context / ts, speed_vs_torch=ts / s)
        row["torch_kernels_per_step"] = torch_kernels(torch, lambda: peer.step(*tup[0]))
    row["launches_per_step"] = count_launches(lambda: (ours.step(*up[0]), dev.synchronize()))
    if torch is not None:  # the same profiler sees every kernel in the process: numba's and cuBLAS's too
        row["kernels_per_step"] = torch_kernels(torch, lambda: (ours.step(*up[0]), dev.synchronize()))
    row["ops_ms"] = op_split(ours, up, args.op_steps, dev, warm=not args.simulate)
    if torch is not None:
        clocked = Torch(torch, shape, ours.weights(), ours.model.no_decay, clock=True, precision=precision)
        row["torch_ops_ms"] = torch_op_split(clocked, tup, args.op_steps)
    return row


def op_split(ours, up, steps, dev, warm=True) -> dict:
    """ms per step by op family, and the step ("step": every op synchronised, so slower than timed;
    eager, since a graph's replay calls no op), after one untimed step when ``warm``."""
    from hpctrain.observe.op_times import OpTimes

    model_dev = ours.model_dev
    plain, graphs, model_plain = dev.ops, ours.graphs, model_dev.ops
    clock = OpTimes(dev, model_dev)  # wraps the tables in place (a 16-bit model's own too); put back below
    ours.graphs = None
    try:
        if warm:   # an untimed step first; the simulator has nothing to warm, and each step costs seconds
            ours.step(*up[0])
            clock.pop()
        totals = {"step": 0.0}
        for i in range(steps):
            t0 = time.perf_counter()
            ours.step(*up[i % len(up)])
            totals["step"] += time.perf_counter() - t0
            for k, v in clock.pop().items():
                totals[k[5:]] = totals.get(k[5:], 0.0) + v
        return {k: v / steps * 1e3 for k, v in sorted(totals.items())}
    finally:
        dev.ops, ours.graphs, model_dev.ops = plain, graphs, model_plain


def torch_op_split(peer, tup, steps) -> dict:
    """PyTorch's split by gpt2_torch.OpClock, the same families; the optimizer timed around its step."""
    peer.step(*tup[0])
    peer.clock.pop(peer.backward_end)
    totals = {"step": 0.0}
    for i in range(steps):
        t0 = time.perf_counter()
        peer.step(*tup[i % len(tup)])
        totals["step"] += time.perf_counter() - t0
        split = peer.clock.pop(peer.backward_end)
        split["t_op_optimizer"] = peer.optimizer_s
        for k, v in split.items():
            totals[k[5:]] = totals.get(k[5:], 0.0) + v
    return {k: v / steps * 1e3 for k, v in sorted(totals.items())}


FAMILIES = ("gemm", "attention", "layernorm", "elementwise", "embedding", "loss", "optimizer")


def table(rows, env) -> str:
    """The Markdown report: one row per shape, then the per-op split."""
    out = [f"GPT training step, one GPU ({env['device']}; {env['versions']})", "",
           f"| shape | precision | tokens/step | validated (max rel. loss diff, {env['validate_steps']} steps) | "
           "hpctrain ms/step | tokens/s | PyTorch ms/step | tokens/s | hpctrain / PyTorch | "
           "launch calls/step (hpctrain) | kernels/step (hpctrain, PyTorch) | MFU | attention | graphs |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        valid = f"{'yes' if r['valid'] else 'NO'} vs {r['validated_against']} ({r['loss_rel_diff']:.1e})"
        lead = f"| {r['shape']} | {r.get('precision', 'fp32')} | {r['tokens_per_step']:,} | {valid} |"
        if not r["valid"]:
            out.append(f"{lead} - | - | - | - | - | - | - | - | - | - |")
            continue
        t = lambda k, f: f.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        out.append(f"{lead} {r['ms_per_step']:.2f} | "
                   f"{r['tokens_per_s']:,.0f} | {t('torch_ms_per_step', '{:.2f}')} | "
                   f"{t('torch_tokens_per_s', '{:,.0f}')} | {t('speed_vs_torch', '{:.2f}x')} | "
                   f"{t('launches_per_step', '{}')} | {t('kernels_per_step', '{}')}, "
                   f"{t('torch_kernels_per_step', '{}')} | {mfu} | {r['attention']} | {r['graphs']} |")
    out += ["", "Memory: activations hpctrain keeps per step (computed), PyTorch's peak allocated over "
            "the validation steps (weights, gradients, optimizer state and activations):", "",
            "| shape | precision | hpctrain activations MB | PyTorch peak allocated MB |", "|---|---|---:|---:|"]
    for r in rows:
        peak = r.get("torch_peak_allocated_bytes")
        out.append(f"| {r['shape']} | {r.get('precision', 'fp32')} | {r['activation_bytes'] / 1e6:,.3f} | "
                   + (f"{peak / 1e6:,.1f} |" if peak else "- |"))
    for r in rows:
        if r.get("ops_ms"):
            theirs = r.get("torch_ops_ms", {})
            out += ["", f"Per-op split, {r['shape']}, {r.get('precision', 'fp32')} (ms per step, every op "
                    "synchronised):", "",
                    "| | " + " | ".join(FAMILIES) + " | step |", "|---|" + "---:|" * (len(FAMILIES) + 1)]
            for who, ops in (("hpctrain", r["ops_ms"]), ("PyTorch", theirs)):
                if ops:
                    out.append(f"| {who} | " + " | ".join(f"{ops.get(f, 0.0):.2f}" for f in FAMILIES)
                               + f" | {ops['step']:.2f} |")
    cost = env.get("launch_cost_us") or {}
    out += ["", "Host cost of one launch (benchmarks/launch_cost.py): "
            + ", ".join(f"{name} {us:.1f} us" for name, us in cost.items())
            + "; GEMM peak (cuBLAS SGEMM 8192^3, measured) "
            + (f"{env['peak_tflops']:.1f} TFLOP/s" if env.get("peak_tflops") else "-")
            + ", datasheet FP32 " + (f"{env['card_peak_tflops']:.0f} TFLOP/s" if env.get("card_peak_tflops") else "-")]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: example gpt2-small (tiny with "
                   "--simulate)")
    p.add_argument("--simulate", action="store_true", help="on numba's CUDA simulator: the tiny shape, 2 steps "
                   "each, validated against the float64 CPU twin (no timing claim)")
    p.add_argument("--validate", type=int, default=10, help="steps whose losses must agree (10)")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="relative loss tolerance (1e-4)")
    p.add_argument("--loss-rtol-16", type=float, default=2e-2, help="relative loss tolerance of a 16-bit "
                   "precision (2e-2)")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"),
                   help="default: fp32 bf16")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before timing (5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (20)")
    p.add_argument("--op-steps", type=int, default=3, help="steps of the per-op split (3)")
    p.add_argument("--attention", default="auto", choices=("auto", "flash", "gemm"),
                   help="hpctrain's model.attention (auto: what a run gets by default)")
    p.add_argument("--graphs", default="auto", choices=("auto", "off"),
                   help="hpctrain's forward and backward as a replayed CUDA graph (train.cuda_graphs): auto "
                   "(where the device can capture) | off")
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "gpu_step.json"))
    args = p.parse_args(argv)
    from hpctrain.device import CudaDevice, gpu_name, simulated

    if args.simulate != simulated():
        p.error("--simulate goes with NUMBA_ENABLE_CUDASIM=1, and a real run with the simulator off")
    if args.simulate:
        args.validate, args.warmup, args.steps, args.op_steps = min(args.validate, 2), 0, 1, 1
        from hpctrain.testing.simulator import make_thread_safe  # the test tool, opted into

        make_thread_safe()
    shapes = args.shapes or (["tiny"] if args.simulate else ["example", "gpt2-small"])
    torch = None
    if not args.simulate:
        try:
            import torch
        except ImportError:
            print("gpu_step.py: PyTorch is not installed (the yardstick): pip install torch", file=sys.stderr)
            return 77
        if not torch.cuda.is_available():
            print("gpu_step.py: PyTorch sees no GPU", file=sys.stderr)
            return 77
        torch.backends.cuda.matmul.allow_tf32 = False  # the default, said explicitly: float32 on both sides
        torch.backends.cudnn.allow_tf32 = False
    dev = CudaDevice("float32", gemm="auto", attention=args.attention)
    can, why = dev.can_capture()
    args.graphs_on = args.graphs == "auto" and can
    args.graphs_why = "--graphs off" if args.graphs == "off" else why
    import numba

    versions = f"numba {numba.__version__}" + (f", torch {torch.__version__}" if torch is not None else "")
    try:
        import cupy

        versions += f", cupy {cupy.__version__}"
    except ImportError:
        pass
    name = "numba CUDA simulator" if args.simulate else gpu_name(0)
    env = {"device": name, "host": platform.node(), "versions": versions, "gemm": dev.gemm,
           "attention": args.attention,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "simulated": args.simulate, "validate_steps": args.validate,
           "launch_cost_us": launch_cost.measure(dev, 2 if args.simulate else 3000),
           "peak_tflops": None if args.simulate else (cublas_peak_flops() or 0) / 1e12 or None,
           "card_peak_tflops": card_peak_tflops(name)}
    rows = []
    for shape, precision in [(s, p) for s in shapes for p in args.precisions]:
        row = measure(shape, args, dev, torch, precision)
        if env["peak_tflops"] and row.get("model_tflops"):
            row["mfu"] = row["model_tflops"] / env["peak_tflops"]   # against the float32 peak, both rows
        rows.append(row)
        print(f"gpu_step.py: {shape} {precision}: " + ("validated" if row["valid"] else "FAILED validation")
              + f" (max relative loss difference {row['loss_rel_diff']:.1e} against {row['validated_against']})",
              flush=True)
    print(table(rows, env))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"benchmark": "gpu_step", "env": env, "rows": rows}, fh, indent=1)
    print(f"JSON: {args.json}")
    return 0 if all(r["valid"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the PyTorch peers share: flags, the step-0 checkpoint, DDP, the timed loop and the metrics.

A peer (torch_ddp.py: the MLP; torch_gpt.py: the GPT) is one function
``build(cfg, world, resume, dtype) -> PeerModel``, handed to :func:`main`,
which does the rest the same way for both:

* flags: hpctrain's own ``--config`` / ``--set`` (``hpctrain.training.config``), ``--resume FILE`` (a step-0
  checkpoint of ``benchmarks/peers/init_checkpoint.py``), ``--trace DIR``;
* threads: ``torch.set_num_threads`` = hpctrain's per-rank share (cores / ranks on the node,
  ``OMP_NUM_THREADS`` if set), one inter-op thread;
* DDP: gloo on the CPU, nccl on a GPU (``train.device``; gloo when ranks share a GPU,
  which NCCL refuses); buckets as hpctrain's: with the defaults
  (``dist.bucket_mb`` 25, ``first_bucket_mb`` 1) DDP's own defaults, which are the same, else
  ``bucket_cap_mb`` = ``dist.bucket_mb`` (DDP's first bucket is then as large); gradients averaged
  over ranks, as in hpctrain. Rendezvous over TCP at rank 0's host, port chosen by rank 0 and
  broadcast with MPI (mpi4py gives the ranks);
* optimizer: ``torch.optim.SGD`` (momentum, nesterov, weight decay) or ``AdamW``, weight decay on
  every parameter but those the model names in ``no_decay`` (hpctrain's rule), with hpctrain's
  ``LRSchedule`` setting the lr of every step;
* per step the loss sum and correct count stay on the device (no sync, no collective: hpctrain
  all-reduces them every step, the peer only once at the end, which favours PyTorch slightly);
  then rank 0 writes hpctrain's metrics JSON lines: step, global loss and accuracy (over all
  predictions: rows x ``per_row``), lr, step_time, samples_per_s (and tokens_per_s for a language
  model), t_data, t_forward, t_backward (DDP's gradient all-reduce overlaps it; its exposed part is
  inside it), t_optimizer, t_other, and the model's ``t_op_*`` when it times its ops.

Exit 77 with one line when PyTorch is not installed (setup.cfg extra ``peers``); 2 for a setting
the peer does not model or a bad input, with one message from rank 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_SKIPPED = 77


@dataclass
class PeerModel:
    """What a peer's ``build`` returns. ``module(x)`` -> logits (..., classes) of this rank's batch,
    weights loaded; ``loss(logits, y)`` -> the mean loss (None: cross-entropy over every prediction);
    ``reader.batch(step)`` -> this rank's (x, y) NumPy arrays of global ``step``;
    ``per_row`` predictions per row (1, or the context of a language model); ``no_decay`` names of
    ``module``'s parameters weight decay must skip; ``describe`` for the start-up line; ``op_clock``
    (optional) times ops: ``start_backward()`` before ``loss.backward()``, ``pop(backward_end)`` ->
    ``{"t_op_<family>": s}`` after it."""

    module: object
    reader: object
    loss: Callable | None = None
    per_row: int = 1
    no_decay: frozenset = frozenset()
    describe: str = ""
    op_clock: object = None
    close: Callable[[], None] = field(default=lambda: None)


def parse_args(doc: str, argv=None):
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--config", help="hpctrain TOML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--resume", required=True, metavar="FILE", help="hpctrain step-0 checkpoint with the weights")
    p.add_argument("--trace", metavar="DIR", help="torch.profiler Chrome trace per rank into DIR")
    return p.parse_args(argv)


def unsupported(cfg, kind: str, script: str) -> str:
    """Why a peer of ``model.kind`` = ``kind`` cannot model ``cfg`` ('' when it can)."""
    if cfg.model.kind != kind:
        other = {"mlp": "torch_ddp.py", "gpt": "torch_gpt.py"}.get(cfg.model.kind, "no peer")
        return f"model.kind={cfg.model.kind!r} ({script} is the {kind} peer; use {other})"
    if cfg.train.grad_accum_steps != 1:
        return "train.grad_accum_steps > 1"
    if cfg.dist.compress != "none":
        return f"dist.compress={cfg.dist.compress!r}"
    if cfg.dist.bucket_mb <= 0:
        return "dist.bucket_mb=0 (DDP always buckets)"
    return ""


def open_step0(path: str):
    """The h5py file of a step-0 hpctrain checkpoint (ValueError for a later step: no optimizer state
    is loaded, so the peer must start where the optimizer is fresh)."""
    import h5py

    f = h5py.File(path, "r")
    step = int(f.attrs["step"])
    if step != 0:
        f.close()
        raise ValueError(f"{path} is a step-{step} checkpoint; the peer starts from a step-0 one "
                         f"(benchmarks/peers/init_checkpoint.py) since it does not load optimizer state")
    return f


def copy_weight(param, f, key: str, transpose: bool = False) -> None:
    """``param`` <- ``f[key]`` (transposed: hpctrain's Linear weights are (in, out), torch's (out, in))."""
    import numpy as np
    import torch

    value = f[key][()]
    want = tuple(param.shape[::-1] if transpose else param.shape)
    if value.shape != want:
        raise ValueError(f"{f.filename}: {key} is {value.shape}, the model wants {want}")
    with torch.no_grad():
        param.copy_(torch.from_numpy(np.ascontiguousarray(value.T if transpose else value)).to(param.dtype))


def rendezvous(world) -> str:
    """tcp://host:port of rank 0 (a free port it picked), the same on every rank."""
    addr = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = f"tcp://{'127.0.0.1' if world.n_nodes == 1 else socket.gethostname()}:{port}"
    return world.comm.bcast(addr, root=0)


def make_optimizer(torch, module, no_decay, o):
    """SGD or AdamW over ``module``'s parameters; those named in ``no_decay`` in a group without decay."""
    named = list(module.named_parameters())
    groups = [{"params": [p for n, p in named if n not in no_decay], "weight_decay": o.weight_decay}]
    if no_decay:
        groups.append({"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0})
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def main(name: str, kind: str, doc: str, build, argv=None) -> int:
    """Run peer ``name`` (its script's stem) of ``model.kind`` = ``kind`` on every rank; ``build``
    makes its :class:`PeerModel` (after the configuration passed :func:`unsupported`)."""
    args = parse_args(doc, argv)
    sys.path.insert(0, REPO)
    from hpctrain.runtime import launched_rank, limit_threads_per_rank

    limit_threads_per_rank()  # before numpy/torch: the same per-rank thread share as hpctrain
    root = launched_rank() == 0
    try:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
    except ImportError as exc:
        if root:
            print(f"{name}: skipped: PyTorch is not installed ({exc}); pip install torch (setup.cfg extra peers)",
                  file=sys.stderr)
        return EXIT_SKIPPED

    from hpctrain.training.config_load import load_config
    from hpctrain.errors import UserError
    from hpctrain.observe.log import Metrics, Timers
    from hpctrain.optim import LRSchedule, peak_lr
    from hpctrain.runtime import init_world

    world = init_world()
    rank, size = world.rank, world.size
    try:
        cfg = load_config(args.config, args.set)
        why = unsupported(cfg, kind, name + ".py")
        if why:
            raise UserError(f"the PyTorch peer does not model {why}")
        dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.train.dtype]
        peer = build(cfg, world, args.resume, dtype)
    except (UserError, ValueError, OSError, KeyError) as exc:  # every rank reads the same inputs: same verdict
        if root:
            print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    use_cuda = cfg.train.device in ("auto", "cuda") and torch.cuda.is_available()
    if cfg.train.device == "cuda" and not use_cuda:
        if root:
            print(f"{name}: error: train.device='cuda' but torch sees no GPU", file=sys.stderr)
        return 2
    device = torch.device(f"cuda:{world.local_rank % torch.cuda.device_count()}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); ranks sharing a GPU (as
    # hpctrain's may) reduce their CUDA tensors through gloo instead
    shared_gpu = use_cuda and world.local_size > torch.cuda.device_count()
    dist.init_process_group("nccl" if use_cuda and not shared_gpu else "gloo", init_method=rendezvous(world),
                            rank=rank, world_size=size)

    model = peer.module.to(device)
    # DDP's defaults are hpctrain's (25 MB buckets, the first 1 MB); an explicit bucket_cap_mb would
    # also make DDP's first bucket that large, so the defaults are passed as None
    defaults = (cfg.dist.bucket_mb, cfg.dist.first_bucket_mb) == (25.0, 1.0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=None if defaults else cfg.dist.bucket_mb,
                                                    gradient_as_bucket_view=True)  # no buffers to sync
    o = cfg.optim
    opt = make_optimizer(torch, model, peer.no_decay, o)
    schedule = LRSchedule(o, peak_lr(o, cfg.train.global_batch), cfg.train.steps)
    metrics = Metrics(cfg.train.metrics, root)
    metrics.begin(None)  # the peer never resumes: a fresh file
    loss_fn = peer.loss or (lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    sync = torch.cuda.synchronize if use_cuda else None
    timers, clock = Timers(sync=sync), peer.op_clock
    stats = torch.zeros((cfg.train.steps, 2), dtype=torch.float64, device=device)  # loss_sum, correct per step
    if root:
        print(f"{name}: torch {torch.__version__}, {size} rank(s) on {world.n_nodes} node(s), "
              f"{dist.get_backend()} on {device}, "
              f"{threads} thread(s) per rank, {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"global batch {cfg.train.global_batch}" + (f"; {peer.describe}" if peer.describe else ""), flush=True)
    prof = _profiler() if args.trace else None
    records = []
    t_start = time.perf_counter()
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        with timers("data"):
            x, y = peer.reader.batch(step)
            x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        with timers("forward"):
            logits = ddp(x)
            loss = loss_fn(logits, y)
        with timers("backward"):
            opt.zero_grad(set_to_none=False)
            if clock is not None:
                clock.start_backward()
            loss.backward()  # DDP reduces gradient buckets during it; it returns when all are averaged
        ops = clock.pop(time.perf_counter()) if clock is not None else {}
        with timers("optimizer"):
            for group in opt.param_groups:
                group["lr"] = schedule.lr(step)
            opt.step()
        with timers("other"):  # kept on the device, no sync and no collective per step (see docstring)
            stats[step, 0] = loss.detach().double() * y.numel()
            stats[step, 1] = (logits.detach().argmax(-1) == y).sum()
        split = timers.pop()
        if clock is not None:
            ops["t_op_optimizer"] = split["optimizer"]
        records.append((time.perf_counter() - t0, split, ops))
        if prof is not None:
            prof.step()
    elapsed = time.perf_counter() - t_start
    dist.all_reduce(stats)  # the global loss and accuracy of every step, in one collective
    rows = cfg.train.global_batch
    for step, (step_time, split, ops) in enumerate(records):
        rates = {"samples_per_s": rows / step_time}
        if peer.per_row > 1:
            rates["tokens_per_s"] = rows * peer.per_row / step_time
        metrics.write(step=step + 1, loss=stats[step, 0].item() / (rows * peer.per_row),
                      accuracy=stats[step, 1].item() / (rows * peer.per_row), lr=schedule.lr(step),
                      step_time=step_time, **rates, threads=threads, **{f"t_{k}": v for k, v in split.items()},
                      **ops)
    metrics.close()
    peer.close()
    if prof is not None:
        prof.stop()
        os.makedirs(args.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace, f"torch-rank{rank:05d}.json"))
    if root:
        unit, per = ("tokens", peer.per_row) if peer.per_row > 1 else ("samples", 1)
        print(f"{name}: done: {cfg.train.steps} steps in {elapsed:.1f} s "
              f"({cfg.train.steps * rows * per / elapsed:,.0f} {unit}/s)", flush=True)
    # Tear down before the interpreter does: a gloo worker thread still releasing a tensor while
    # Python finalises aborts the process ("terminate called without an active exception").
    dist.barrier()
    del ddp, opt, model, peer, logits, loss, x, y
    gc.collect()
    dist.destroy_process_group()
    return 0


def _profiler():
    import torch
    import torch.profiler as tp

    acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = tp.profile(activities=acts)
    prof.start()
    return prof

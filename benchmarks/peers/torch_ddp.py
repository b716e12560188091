"""PyTorch DDP peer: hpctrain's MLP, weights, data order, batch, optimizer and schedule, in PyTorch.

    python benchmarks/peers/init_checkpoint.py --set ... --dir runs/init          # step-0 weights
    mpirun -n 2 python benchmarks/peers/torch_ddp.py --set ... --resume runs/init/ckpt-00000000.h5 \\
        --set train.metrics=runs/peer.jsonl

It takes hpctrain's own ``--config`` / ``--set`` (parsed by ``hpctrain.config``),
so the same flags describe both runs:

* model: ``Linear(+ReLU | GELU(tanh))`` per ``model.hidden``, then a Linear to
  the classes, mean cross-entropy; weights and biases from the step-0
  checkpoint given by ``--resume`` (hpctrain's ``/model/fc<i>/weight`` is (in,
  out), transposed into torch's (out, in));
* data: hpctrain's ``DistributedSampler`` and ``BatchReader`` (permutation per
  (shuffle_seed, epoch), rank r takes rows [r b, (r+1) b) of each global batch,
  the same read-ahead from HDF5), so data cost and order are identical;
* optimizer: ``torch.optim.SGD`` (momentum, nesterov, weight decay) or
  ``AdamW``, with hpctrain's ``LRSchedule`` setting the lr of every step;
* DDP: gloo on the CPU, nccl on a GPU (``train.device``); buckets as
  hpctrain's: with the defaults (``dist.bucket_mb`` 25, ``first_bucket_mb`` 1)
  DDP's own defaults, which are the same, else ``bucket_cap_mb`` =
  ``dist.bucket_mb`` (DDP's first bucket is then as large); gradients averaged
  over ranks, as in hpctrain. Rendezvous over TCP at rank 0's host, port chosen
  by rank 0 and broadcast with MPI (mpi4py gives the ranks).
* threads: ``torch.set_num_threads`` = hpctrain's per-rank share
  (cores / ranks on the node, ``OMP_NUM_THREADS`` if set), one inter-op thread.

Per step the loss sum and correct count stay on the device (no sync, no
collective: hpctrain all-reduces them every step, PyTorch here only once at the
end, which favours PyTorch slightly); then rank 0 writes hpctrain's metrics JSON
lines (step, global loss and accuracy, lr, step_time, samples_per_s, t_data,
t_forward, t_backward (DDP's gradient all-reduce overlaps it; its exposed part is
inside it), t_optimizer, t_other). ``--trace DIR``: a torch.profiler Chrome trace
per rank. Exit 77 with one line when PyTorch is not installed (setup.cfg extra
``peers``); 2 for a setting the peer does not model.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_SKIPPED = 77


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="hpctrain TOML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--resume", required=True, metavar="FILE", help="hpctrain step-0 checkpoint with the weights")
    p.add_argument("--trace", metavar="DIR", help="torch.profiler Chrome trace per rank into DIR")
    return p.parse_args(argv)


def unsupported(cfg) -> str:
    """Why the peer cannot model ``cfg`` ('' when it can)."""
    if cfg.train.grad_accum_steps != 1:
        return "train.grad_accum_steps > 1"
    if cfg.dist.compress != "none":
        return f"dist.compress={cfg.dist.compress!r}"
    if cfg.dist.bucket_mb <= 0:
        return "dist.bucket_mb=0 (DDP always buckets)"
    return ""


def load_weights(model_layers, path: str, dtype) -> None:
    """Copy /model/fc<i>/{weight,bias} of an hpctrain checkpoint into torch Linear layers."""
    import h5py
    import numpy as np
    import torch

    with h5py.File(path, "r") as f:
        step = int(f.attrs["step"])
        if step != 0:
            raise ValueError(f"{path} is a step-{step} checkpoint; the peer starts from a step-0 one "
                             f"(benchmarks/peers/init_checkpoint.py) since it does not load optimizer state")
        for i, layer in enumerate(model_layers):
            w, b = f[f"/model/fc{i}/weight"][()], f[f"/model/fc{i}/bias"][()]
            if w.shape != (layer.in_features, layer.out_features):
                raise ValueError(f"{path}: /model/fc{i}/weight is {w.shape}, the model wants "
                                 f"{(layer.in_features, layer.out_features)}")
            with torch.no_grad():
                layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)).to(dtype))
                layer.bias.copy_(torch.from_numpy(b).to(dtype))


def rendezvous(world) -> str:
    """tcp://host:port of rank 0 (a free port it picked), the same on every rank."""
    addr = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = f"tcp://{'127.0.0.1' if world.n_nodes == 1 else socket.gethostname()}:{port}"
    return world.comm.bcast(addr, root=0)


def main(argv=None) -> int:
    args = parse_args(argv)
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
            print(f"torch_ddp: skipped: PyTorch is not installed ({exc}); pip install torch (setup.cfg extra peers)",
                  file=sys.stderr)
        return EXIT_SKIPPED
    import numpy as np

    from hpctrain.config import load_config
    from hpctrain.data import BatchReader, DistributedSampler, open_dataset
    from hpctrain.errors import UserError
    from hpctrain.log import Metrics, Timers
    from hpctrain.optim import LRSchedule, peak_lr
    from hpctrain.runtime import init_world

    world = init_world()
    rank, size = world.rank, world.size
    try:
        cfg = load_config(args.config, args.set)
        why = unsupported(cfg)
        if why:
            raise UserError(f"the PyTorch peer does not model {why}")
        ds = open_dataset(cfg.data.train, "data.train")
        sampler = DistributedSampler(ds.n, cfg.train.global_batch, rank, size, cfg.data.shuffle_seed)
        dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.train.dtype]
        widths = [ds.dim, *cfg.model.hidden, ds.n_classes]
        linears = [torch.nn.Linear(widths[i], widths[i + 1], dtype=dtype) for i in range(len(widths) - 1)]
        load_weights(linears, args.resume, dtype)
    except (UserError, ValueError, OSError, KeyError) as exc:  # every rank reads the same inputs: same verdict
        if root:
            print(f"torch_ddp: error: {exc}", file=sys.stderr)
        return 2
    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    use_cuda = cfg.train.device in ("auto", "cuda") and torch.cuda.is_available()
    if cfg.train.device == "cuda" and not use_cuda:
        if root:
            print("torch_ddp: error: train.device='cuda' but torch sees no GPU", file=sys.stderr)
        return 2
    device = torch.device(f"cuda:{world.local_rank % torch.cuda.device_count()}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=rendezvous(world), rank=rank,
                            world_size=size)

    act = torch.nn.ReLU if cfg.model.activation == "relu" else (lambda: torch.nn.GELU(approximate="tanh"))
    layers = []
    for i, lin in enumerate(linears):
        layers += [lin] + ([act()] if i < len(linears) - 1 else [])
    model = torch.nn.Sequential(*layers).to(device)
    # DDP's defaults are hpctrain's (25 MB buckets, the first 1 MB); an explicit bucket_cap_mb would
    # also make DDP's first bucket that large, so the defaults are passed as None
    defaults = (cfg.dist.bucket_mb, cfg.dist.first_bucket_mb) == (25.0, 1.0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=None if defaults else cfg.dist.bucket_mb,
                                                    gradient_as_bucket_view=True)  # no buffers to sync
    o = cfg.optim
    if o.name == "sgd":
        opt = torch.optim.SGD(ddp.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                              nesterov=o.nesterov)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay)
    schedule = LRSchedule(o, peak_lr(o, cfg.train.global_batch), cfg.train.steps)
    reader = BatchReader(ds, sampler, np.float32 if dtype == torch.float32 else np.float64)
    metrics = Metrics(cfg.train.metrics, root)
    sync = torch.cuda.synchronize if use_cuda else None
    timers = Timers(sync=sync)
    stats = torch.zeros((cfg.train.steps, 2), dtype=torch.float64, device=device)  # loss_sum, correct per step
    if root:
        print(f"torch_ddp: torch {torch.__version__}, {size} rank(s) on {world.n_nodes} node(s), "
              f"{dist.get_backend()} on {device}, "
              f"{threads} thread(s) per rank, {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"global batch {cfg.train.global_batch}", flush=True)
    prof = _profiler() if args.trace else None
    records = []
    t_start = time.perf_counter()
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        with timers("data"):
            x, y = reader.batch(step)
            x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        with timers("forward"):
            logits = ddp(x)
            loss = F.cross_entropy(logits, y)
        with timers("backward"):
            opt.zero_grad(set_to_none=False)
            loss.backward()  # DDP reduces gradient buckets during it; it returns when all are averaged
        with timers("optimizer"):
            for group in opt.param_groups:
                group["lr"] = schedule.lr(step)
            opt.step()
        with timers("other"):  # kept on the device, no sync and no collective per step (see docstring)
            stats[step, 0] = loss.detach().double() * len(y)
            stats[step, 1] = (logits.detach().argmax(1) == y).sum()
        records.append((time.perf_counter() - t0, timers.pop()))
        if prof is not None:
            prof.step()
    elapsed = time.perf_counter() - t_start
    dist.all_reduce(stats)  # the global loss and accuracy of every step, in one collective
    rows = cfg.train.global_batch
    for step, (step_time, split) in enumerate(records):
        metrics.write(step=step + 1, loss=stats[step, 0].item() / rows, accuracy=stats[step, 1].item() / rows,
                      lr=schedule.lr(step), step_time=step_time, samples_per_s=rows / step_time,
                      threads=threads, **{f"t_{k}": v for k, v in split.items()})
    metrics.close()
    if prof is not None:
        prof.stop()
        os.makedirs(args.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace, f"torch-rank{rank:05d}.json"))
    if root:
        print(f"torch_ddp: done: {cfg.train.steps} steps in {elapsed:.1f} s "
              f"({cfg.train.steps * cfg.train.global_batch / elapsed:,.0f} samples/s)", flush=True)
    # Tear down before the interpreter does: a gloo worker thread still releasing a tensor while
    # Python finalises aborts the process ("terminate called without an active exception").
    dist.barrier()
    del ddp, opt, model, linears, layers, logits, loss, x, y
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


if __name__ == "__main__":
    sys.exit(main())

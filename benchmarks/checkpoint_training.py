"""Checkpoints of a real training run: each rank's host memory, its stall and the bandwidth, side by side.

    mpirun -n 4 --oversubscribe python benchmarks/checkpoint_training.py --layout zero3 --load-layout zero1@2 p3@3
    mpirun -n 4 --oversubscribe python benchmarks/checkpoint_training.py --layout p2t2 --load-layout zero3
    mpirun -n 2 python benchmarks/checkpoint_training.py --layout zero1 --n-layer 2 --d-model 128   # quick

A GPT of GPT-2's proportions (``--n-layer``, ``--d-model``, 64-channel heads, byte vocabulary, AdamW,
float32) trains in this mpirun job at ``--layout`` (zero0/zero1/zero3, t2-zero1, p2, p3, p2t2; each rank
binds its threads as the trainer does). Then, in the same job, each figure next to its yardstick:

  save memory   a synchronous save of the trained state: the rank's peak resident set during the save
                (sampled every 2 ms from /proc/self/statm) above its resident set just before, against
                the bytes the rank writes (target: <= 1.1 x those + 64 MiB)
  load memory   a trainer of each ``--load-layout`` resumes from that file (LAYOUT@K: on the job's
                first K ranks, the others idle): peak above the resident set before the load,
                against the bytes its layout needs (same target)
  stall         ``--steps`` steps with a save every ``--every`` steps, synchronous then in the
                background (checkpoint.async_save), same state: the median time a save stops the step
                (t_checkpoint), and the first step after each background save against the steps of a
                run without saves (targets: stall <= 10 % of the synchronous save; that step <= 1.25x)
  bandwidth     the synchronous save's bytes / time against each rank os.pwrite'ing the same bytes into
                one file and fsync'ing it (target: >= 0.8x)
  moved         bytes of parameters or optimizer state sent between ranks during a save: 0 by
                construction (owners write, only CRCs and metadata move); printed from the writers' plan

Prints one table (rank 0; max over ranks where ranks differ) and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
LAYOUTS = {"zero0": (0, 1, 1), "zero1": (1, 1, 1), "zero3": (3, 1, 1), "t2-zero1": (1, 2, 1), "p2": (0, 1, 2),
           "p3": (0, 1, 3), "p2t2": (1, 2, 2)}   # (dist.zero, t, p)
MIB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="zero3", choices=sorted(LAYOUTS))
    p.add_argument("--load-layout", nargs="+", default=[("zero1", 0)], type=load_layout,
                   help="LAYOUT or LAYOUT@K (K ranks of the job load; default: all)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--dir", default=os.path.join(REPO, "runs", "bench", "ckpt-train"))
    p.add_argument("--text", default=os.path.join(REPO, "data", "text.h5"), help="token file (made if missing)")
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "checkpoint_training.json"))
    return p.parse_args(argv)


def load_layout(text: str) -> tuple[str, int]:
    """'zero1' -> ('zero1', 0: every rank); 'zero1@2' -> ('zero1', 2)."""
    name, _, ranks = text.partition("@")
    if name not in LAYOUTS or ranks and not ranks.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: LAYOUT[@RANKS], LAYOUT one of {', '.join(sorted(LAYOUTS))}")
    return name, int(ranks or 0)


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The highest resident set of this process while inside (sampled every 2 ms), above the start."""

    def __enter__(self):
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.extra = self.peak - self.start
        return False


def config(args, layout, ckpt_dir, steps, every=0, background=False, resume=""):
    from hpctrain.training.config import Config

    zero, t, p = LAYOUTS[layout]
    cfg = Config()
    cfg.model.kind, cfg.model.n_layer, cfg.model.d_model = "gpt", args.n_layer, args.d_model
    cfg.model.n_head, cfg.model.context = max(1, args.d_model // 64), args.context
    cfg.data.train, cfg.train.eval_tokens, cfg.train.eval_every = args.text, 0, 0
    cfg.train.target_val_bpb = cfg.train.target_bpb_vs_bigram = 0
    cfg.dist.zero, cfg.dist.tensor_parallel, cfg.dist.pipeline_parallel, cfg.dist.allreduce = zero, t, p, "ring"
    cfg.train.global_batch, cfg.train.grad_accum_steps = 4 * p, p
    cfg.train.steps, cfg.train.log_every, cfg.train.dtype = steps, 10**6, "float32"
    cfg.optim.name = "adamw"
    cfg.checkpoint.dir, cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes = ckpt_dir, every, 0
    cfg.checkpoint.keep_last, cfg.checkpoint.async_save, cfg.checkpoint.resume = 1, background, resume
    cfg.train.metrics = os.path.join(ckpt_dir, "metrics.jsonl")
    return cfg.validate()


def trainer_of(cfg, world):
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    trainer = Trainer(cfg, world, Log(False))
    trainer.data.eval_shard = None   # no evaluation (the final one scores the whole /val split: minutes, and not
    return trainer                   # what is measured here)


def written_bytes(trainer) -> int:
    from hpctrain.ckpt.state import training_state

    return sum(int(__import__("numpy").prod(c)) * e.dtype.itemsize for e in training_state(trainer.state, trainer.plan)
               if e.pieces is not None for _, c, _ in e.pieces)


def raw_pwrite(world, path, nbytes) -> float:
    """Each rank writes ``nbytes`` (its own count) at its offset of one file, then fsyncs: seconds, max over ranks."""
    import numpy as np

    offset = world.comm.exscan(nbytes) or 0
    if world.rank == 0:
        open(path, "wb").close()
    buf = np.full(nbytes, 7, np.uint8)
    world.comm.Barrier()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY)
    view, at = memoryview(buf), offset
    while len(view):
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    os.fsync(fd)
    os.close(fd)
    return world.comm.allreduce(time.perf_counter() - t0, op=max_op())


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def steps_of(path):
    with open(path) as fh:
        return [r for r in map(json.loads, fh) if "step_time" in r]


def main(argv=None) -> int:
    from hpctrain.runtime import init_world, limit_threads_per_rank, yield_when_oversubscribed

    limit_threads_per_rank()      # as `python -m hpctrain train` does: before numpy, one thread pool per core,
    yield_when_oversubscribed()   # not per rank; ranks that wait yield their core (before MPI_Init)
    args = parse_args(argv)
    world = init_world()
    if world.rank == 0 and not os.path.exists(args.text):
        os.makedirs(os.path.dirname(args.text), exist_ok=True)
        subprocess.run([sys.executable, "-m", "hpctrain", "data", "text", "--out", args.text], cwd=REPO, check=True)
    base = world.comm.bcast(tempfile.mkdtemp(prefix="ckpt-train-", dir=_made(args.dir)) if world.rank == 0 else None)
    out = {"layout": args.layout, "load_layouts": [f"{n}@{k or world.size}" for n, k in args.load_layout],
           "ranks": world.size, "n_layer": args.n_layer,
           "d_model": args.d_model, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    # 1. a few steps at --layout, then one synchronous save, its peak memory measured
    d1 = _sub(world, base, "save")
    trainer = trainer_of(config(args, args.layout, d1, 2), world)
    trainer.run()
    writes = written_bytes(trainer)
    world.comm.Barrier()
    with PeakRss() as save_mem:
        t0 = time.perf_counter()
        path = trainer.checkpoints.save(trainer.state)
        t_save = world.comm.allreduce(time.perf_counter() - t0, op=max_op())
    total = world.comm.allreduce(writes)
    t_raw = raw_pwrite(world, os.path.join(base, "raw"), writes)
    os.remove(os.path.join(base, "raw")) if world.rank == 0 else None
    trainer.close(0)
    del trainer

    # 2. the loads at each --load-layout (on K of the ranks): peak memory against the bytes each layout needs
    loads = [load_on(args, world, base, path, layout, ranks) for layout, ranks in args.load_layout]

    # 3. the stall: no saves, synchronous saves, background saves (fresh runs, same seed)
    stall = {}
    for name, every, background in (("none", 0, False), ("sync", args.every, False), ("async", args.every, True)):
        d = _sub(world, base, name)
        run = trainer_of(config(args, args.layout, d, args.steps, every, background), world)
        run.run()
        run.close(0)
        world.comm.Barrier()
        stall[name] = steps_of(os.path.join(d, "metrics.jsonl")) if world.rank == 0 else []
    mine = {"writes": writes, "save_extra": save_mem.extra, "loads": loads}
    every_rank = world.comm.gather(mine)
    if world.rank == 0:
        _report(args, out, every_rank, stall, t_save, t_raw, total)
        subprocess.run(["rm", "-rf", base])
    return 0


def load_on(args, world, base, path, layout, ranks) -> dict | None:
    """Resume a trainer of ``layout`` from ``path`` on the first ``ranks`` ranks of ``world`` (0: all):
    this rank's {needs, extra} (peak RSS above the start), or None where it sat out."""
    from mpi4py import MPI

    from hpctrain.ckpt.state import needed_boxes
    from hpctrain.runtime import init_world

    ranks = ranks or world.size
    directory = _sub(world, base, f"load-{layout}-{ranks}")
    sub = world.comm.Split(0 if world.rank < ranks else MPI.UNDEFINED, world.rank)
    mine = None
    if sub != MPI.COMM_NULL:
        loader = trainer_of(config(args, layout, directory, 2), init_world(sub))
        needs = sum(b.size for boxes in needed_boxes(loader.state, loader.plan) for b in boxes) * 4  # float32
        for array in loader.state.optimizer.state().values():
            array[...] = 0   # resident, as after the run's first step (zeros are untouched pages until written)
        loader.checkpoints.c.resume = path
        sub.Barrier()
        with PeakRss() as load_mem:
            loader.checkpoints.resume(loader.state)
        loader.close(0)
        del loader
        mine = {"needs": needs, "extra": load_mem.extra}
        sub.Free()
    world.comm.Barrier()
    return mine


def _made(path):
    os.makedirs(path, exist_ok=True)
    return path


def _sub(world, base, name):
    path = os.path.join(base, name)
    if world.rank == 0:
        os.makedirs(path, exist_ok=True)
    world.comm.Barrier()
    return path


def _report(args, out, ranks, stall, t_save, t_raw, total) -> None:
    save_ok = all(r["save_extra"] <= 1.1 * r["writes"] + 64 * MIB for r in ranks)
    load_ok = all(m["extra"] <= 1.1 * m["needs"] + 64 * MIB for r in ranks for m in r["loads"] if m)
    sync_saves = [r["t_checkpoint"] for r in stall["sync"] if "t_checkpoint" in r]
    # the last step's save is synchronous (the run's end): not a background save's stall
    async_saves = [r["t_checkpoint"] for r in stall["async"] if "t_checkpoint" in r and r["step"] != args.steps]
    after = {r["step"] + 1 for r in stall["async"] if "t_checkpoint" in r}
    overlap = [r["step_time"] - r.get("t_checkpoint", 0) for r in stall["async"] if r["step"] in after]
    plain = [r["step_time"] for r in stall["none"][1:]]
    s_sync, s_async = statistics.median(sync_saves), statistics.median(async_saves)
    s_plain, s_overlap = statistics.median(plain), statistics.median(overlap) if overlap else float("nan")
    bandwidth = t_raw / t_save
    loads = [f"{name}@{k or len(ranks)}" for name, k in args.load_layout]
    print(f"checkpoints of a GPT (n_layer {args.n_layer}, d_model {args.d_model}) trained at {args.layout} on "
          f"{len(ranks)} ranks, loaded at {', '.join(loads)}; {out['date']}, {out['host']}")
    print("| rank | writes MiB | save extra RSS MiB | target MiB |" + "".join(
        f" {name}: needs MiB | extra RSS MiB | target MiB |" for name in loads))
    print("|---:" * (4 + 3 * len(loads)) + "|")
    for k, r in enumerate(ranks):
        cells = "".join(" - | - | - |" if m is None else f" {m['needs'] / MIB:.1f} | {m['extra'] / MIB:.1f} | "
                        f"{(1.1 * m['needs'] + 64 * MIB) / MIB:.1f} |" for m in r["loads"])
        print(f"| {k} | {r['writes'] / MIB:.1f} | {r['save_extra'] / MIB:.1f} | "
              f"{(1.1 * r['writes'] + 64 * MIB) / MIB:.1f} |" + cells)
    print(f"save memory: {'met' if save_ok else 'MISSED'}; load memory: {'met' if load_ok else 'MISSED'}")
    print(f"stall: synchronous save {s_sync * 1e3:.1f} ms, background save {s_async * 1e3:.1f} ms "
          f"({s_async / s_sync:.3f}x, target <= 0.10: {'met' if s_async <= 0.1 * s_sync else 'MISSED'})")
    print(f"first step after a background save {s_overlap * 1e3:.1f} ms against {s_plain * 1e3:.1f} ms without saves "
          f"({s_overlap / s_plain:.2f}x, target <= 1.25: {'met' if s_overlap <= 1.25 * s_plain else 'MISSED'})")
    totals = {name: sum(r["step_time"] for r in runs) for name, runs in stall.items()}
    print(f"all {args.steps} steps, saves included: {totals['none']:.1f} s without saves, {totals['sync']:.1f} s "
          f"with synchronous saves, {totals['async']:.1f} s with background saves")
    print(f"bandwidth: save of {total / MIB:.1f} MiB in {t_save:.3f} s, raw pwrite + fsync of the same bytes "
          f"{t_raw:.3f} s: {bandwidth:.2f}x (target >= 0.8: {'met' if bandwidth >= 0.8 else 'MISSED'})")
    print("moved between ranks during a save: 0 bytes of parameters or optimizer state (owners write)")
    out.update(ranks_bytes=ranks, t_save=t_save, t_raw=t_raw, total=total, stall_sync=s_sync, stall_async=s_async,
               step_plain=s_plain, step_overlap=s_overlap, run_seconds=totals, stalls_sync=sync_saves,
               stalls_async=async_saves, save_ok=save_ok, load_ok=load_ok)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())

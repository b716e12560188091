"""Training throughput and the per-step split at 1, 2, 4 ... ranks (weak scaling).

    python benchmarks/train_throughput.py --ranks 1 2 4            # launches mpirun itself
    python benchmarks/train_throughput.py --device cuda --ranks 1  # on a GPU node (default: cpu)
    mpirun -n 4 python benchmarks/train_throughput.py --worker --out r.json --data d.h5  # one configuration
                                                                   # (JSON row only, no table)

Each configuration keeps the per-rank batch fixed (weak scaling), warms up,
then times ``--steps`` steps. Per phase (data, forward, backward, allreduce,
optimizer) it reports the mean per step on the slowest rank. Yardsticks in the
same run: a bare MPI_Allreduce of the gradient buffer's size (what the
all-reduce phase could cost at best with this MPI), and ideal scaling from the
1-rank run (speedup / min(ranks, cores) = efficiency per core in use).
Validates first: losses finite and parameters identical on every rank.
Writes JSON (--json) and prints a Markdown table. A configuration that cannot
run (e.g. --device cuda without a GPU) ends the benchmark with its message and
exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("data", "forward", "backward", "allreduce", "optimizer")


def worker(args) -> None:
    from hpctrain.runtime import limit_threads_per_rank

    limit_threads_per_rank()
    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, REPO)
    from hpctrain.training.config import Config
    from hpctrain.errors import EXIT_USER_ERROR, UserError
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.data.synth import write_synthetic
    from hpctrain.training.trainer import Trainer

    world = init_world()
    if world.is_root and not os.path.exists(args.data):
        write_synthetic(args.data, args.n, args.dim, 10, seed=1)
    world.comm.Barrier()
    cfg = Config()
    cfg.data.train, cfg.data.eval = args.data, ""
    cfg.model.hidden = [args.width] * args.layers
    cfg.train.global_batch = args.batch * world.size
    cfg.train.steps = args.warmup + args.steps
    cfg.optim.warmup_steps = 0
    cfg.train.device = args.device
    try:
        trainer = Trainer(cfg.validate(), world, Log(False))
    except UserError as exc:  # agreed on every rank (e.g. train.device='cuda' without a GPU)
        if world.is_root:
            with open(args.out, "w") as fh:
                json.dump({"error": str(exc)}, fh)  # the orchestrator prints it once
            print(f"train_throughput: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)

    def one_step():
        """The run loop's step: the batch read (the data phase), the judged step, the step advanced."""
        with trainer.timers("data"):
            x, y = trainer.data.reader.batch(trainer.step)
        result = trainer.stepper.run(trainer.step, x, y)
        trainer.step += 1
        return result

    losses, splits = [], []
    for _ in range(args.warmup):  # JIT compilation, first-touch allocation
        one_step()
    world.comm.Barrier()
    t0 = MPI.Wtime()
    for _ in range(args.steps):
        result = one_step()
        losses.append(result.loss)
        splits.append(result.phases)   # seconds per phase, popped by the step
    world.comm.Barrier()
    wall = MPI.Wtime() - t0

    # validate before reporting
    assert np.all(np.isfinite(losses)), "non-finite loss"
    params = trainer.device.to_host(trainer.model.flat.data)
    ref = world.comm.bcast(params if world.is_root else None, root=0)
    assert np.array_equal(params, ref), "parameters differ between ranks"

    # yardstick: a bare MPI_Allreduce of the same number of bytes (host buffers, whatever the device)
    buf = np.zeros(trainer.model.flat.size, trainer.device.dtype)
    bare = []
    for i in range(args.warmup + args.steps):
        world.comm.Barrier()
        t = MPI.Wtime()
        world.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        if i >= args.warmup:
            bare.append(MPI.Wtime() - t)

    mean = {p: sum(s.get(p, 0.0) for s in splits) / len(splits) for p in PHASES}
    mean["bare_allreduce"] = float(np.median(bare))
    slowest = {p: world.comm.allreduce(v, op=MPI.MAX) for p, v in mean.items()}
    if world.is_root:
        result = {"ranks": world.size, "device": trainer.device.describe(), "per_rank_batch": args.batch,
                  "global_batch": cfg.train.global_batch,
                  "params": int(params.size), "steps": args.steps, "wall_s": wall,
                  "samples_per_s": cfg.train.global_batch * args.steps / wall,
                  "step_ms": 1e3 * wall / args.steps,
                  "split_ms": {p: 1e3 * v for p, v in slowest.items()}}
        with open(args.out, "w") as fh:
            json.dump(result, fh)


def orchestrate(args) -> None:
    rows = []
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "bench.h5")
        for n in args.ranks:
            out = os.path.join(tmp, f"n{n}.json")
            cmd = ["mpirun", "-n", str(n), "--oversubscribe", sys.executable, os.path.abspath(__file__),
                   "--worker", "--out", out, "--data", data, "--batch", str(args.batch),
                   "--width", str(args.width), "--layers", str(args.layers), "--dim", str(args.dim),
                   "--n", str(args.n), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--device", args.device]
            # output captured: a user error (e.g. --device cuda without a GPU) is then one
            # line, not the same message plus mpirun's banners; anything else is replayed
            proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=args.timeout, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            result = None
            if os.path.exists(out):
                with open(out) as fh:
                    result = json.load(fh)
            if result is not None and "error" in result:
                print(f"train_throughput: error at {n} rank(s): {result['error']}", file=sys.stderr)
                sys.exit(2)
            sys.stderr.write(proc.stdout)
            if proc.returncode != 0 or result is None:
                print(f"train_throughput: mpirun -n {n} failed (exit {proc.returncode}; output above)", file=sys.stderr)
                sys.exit(1)
            rows.append(result)
    base = rows[0]["samples_per_s"] / rows[0]["ranks"]
    cores = len(os.sched_getaffinity(0))
    for r in rows:
        r["speedup_vs_1"] = r["samples_per_s"] / (base * 1)
        r["efficiency_per_core"] = r["speedup_vs_1"] / min(r["ranks"], cores)
    report = {"benchmark": "train_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"cores": cores, "cpu": _cpu_name()},
              "device": args.device, "device_used": rows[0]["device"],
              "model": {"dim": args.dim, "width": args.width, "layers": args.layers, "classes": 10,
                        "dtype": "float32"},
              "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"\nmodel {args.dim}-{'-'.join([str(args.width)] * args.layers)}-10 ({rows[0]['params']:,} params, "
          f"float32), device {rows[0]['device']} [--device {args.device}], per-rank batch {args.batch}, "
          f"{args.steps} timed steps, {cores} cores\n")
    head = ("| ranks | global batch | samples/s | speedup | eff/core | step ms | data | forward | backward "
            "| allreduce | bare MPI_Allreduce | optimizer |")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for r in rows:
        s = r["split_ms"]
        print(f"| {r['ranks']} | {r['global_batch']} | {r['samples_per_s']:,.0f} | {r['speedup_vs_1']:.2f}x | "
              f"{r['efficiency_per_core']:.2f} | {r['step_ms']:.2f} | {s['data']:.2f} | {s['forward']:.2f} | "
              f"{s['backward']:.2f} | {s['allreduce']:.2f} | {s['bare_allreduce']:.2f} | {s['optimizer']:.2f} |")
    print(f"\n(times in ms per step, mean over steps on the slowest rank; JSON: {args.json})")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="rank counts to run (default 1 2 4)")
    p.add_argument("--batch", type=int, default=256, help="per-rank batch (weak scaling)")
    p.add_argument("--width", type=int, default=512, help="hidden width")
    p.add_argument("--layers", type=int, default=2, help="hidden layers")
    p.add_argument("--dim", type=int, default=64, help="input features")
    p.add_argument("--n", type=int, default=65536, help="synthetic samples")
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"],
                   help="train.device for every rank (default cpu, so numbers stay comparable)")
    p.add_argument("--json", default="runs/bench/train_throughput.json", help="where to write results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    worker(args) if args.worker else orchestrate(args)


if __name__ == "__main__":
    main()

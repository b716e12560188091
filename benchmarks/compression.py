"""Gradient compression: cost per call against MPI_Allreduce, and what it buys in training.

    mpirun -n 2 python benchmarks/compression.py                        # part A, 16 MB bucket
    mpirun -n 4 --oversubscribe python benchmarks/compression.py --mb 4
    python benchmarks/compression.py --train --model gpt --seeds 0 1 2 \
        --launcher "benchmarks/emulated_cluster.sh --rate 100mbit --np 4 --"

Part A (under mpirun, any number of ranks): one synthetic bucket shaped like a
layer stack (d x d matrices, each followed by a d-vector; d = 1024 unless the
bucket is too small), summed over ranks by ``CompressedSum`` per compressor.

1. validate: on x = rank + (index mod 16) (small integers, exact in fp16 and
   bf16 for up to 9 ranks) none, fp16 and bf16 must give the closed form
   size*(index mod 16) + size*(size-1)/2 exactly (#wrong); every compressor
   must leave identical bytes on every rank (#differ). The lossy ones report
   the relative error of one call on a Gaussian bucket (no residual yet).
2. warm up, then time: Barrier, Wtime around one call, max over ranks per call;
   compressors and the MPI_Allreduce yardstick take turns call by call, so
   load from elsewhere hits all alike. "x MPI" = MPI time / our time.

Part B (``--train``, plain python, no mpirun around it): ``python -m hpctrain
train`` once per compressor spec and seed through ``--launcher``, each writing
per-step metrics; from them bytes per step, encode + decode time, the loss
curve against steps and seconds, and the time to a target loss
(benchmarks/compression_train.py has the definitions). ``--model gpt`` trains
examples/gpt-compress.toml (the GPT of docs/benchmarks.md), ``--model mlp``
examples/mlp.toml; ``--config`` names another.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from compression_report import dump, fmt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARDSTICK = "MPI_Allreduce"
PERIOD = 16  # see the docstring: keeps every partial sum an integer exact in bf16
EXACT = ("none", "fp16", "bf16")  # compressors whose sum of small integers must be exact
STEP = 1000  # Context.step of timed calls: past any powersgd start_step


MODELS = {  # --model: the config part B trains and the specs it compares by default
    "mlp": ("examples/mlp.toml", "none,topk(0.01),powersgd(4),sign"),
    "gpt": ("examples/gpt-compress.toml", "none,fp16,bf16,topk(0.01),randk(0.01),sign,powersgd(4),topk(0.01)@inter"),
}


def split_specs(text: str) -> list[str]:
    """'none,topk(0.01),powersgd(4,10)' -> specs; commas inside parentheses stay."""
    return [s.strip() for s in re.findall(r"[^,(]+(?:\([^)]*\))?[^,]*", text) if s.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressors", default="none,fp16,bf16,topk(0.01),randk(0.01),sign,powersgd(4)")
    p.add_argument("--mb", type=float, default=16, help="part A bucket size, MiB of float32 (16)")
    p.add_argument("--warmup", type=int, default=2, help="part A untimed calls per compressor")
    p.add_argument("--repeats", type=int, default=5, help="part A timed calls per compressor (median)")
    p.add_argument("--train", action="store_true", help="part B: training runs instead of part A")
    p.add_argument("--model", choices=sorted(MODELS), default="mlp", help="part B: the model (mlp)")
    p.add_argument("--train-compressors", help="part B specs COMPRESSOR[+momentum][@SCOPE][:STEPS] (+momentum: "
                   "dist.compress_momentum; @inter: hierarchical "
                   "all-reduce, compress_scope inter; :STEPS: train.steps); default per --model")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="part B train.seed values, each run per spec")
    p.add_argument("--launcher", default="mpirun -n 2 --oversubscribe", help="part B command prefix")
    p.add_argument("--baseline", help="part B: take the 'none' runs from this earlier part B JSON (same config, "
                   "launcher and seeds) instead of training them again")
    p.add_argument("--config", help="part B config (default per --model)")
    p.add_argument("--set", action="append", default=[], help="extra --set for every part B run")
    p.add_argument("--window", type=int, default=50, help="part B, MLP: training-loss smoothing, steps (50)")
    p.add_argument("--target-loss", type=float, default=0.0,
                   help="0: --target-factor x none's last curve point of the same seed (for the GPT a 32,768-token "
                        "evaluation)")
    p.add_argument("--target-factor", type=float, default=1.02,
                   help="target over none's last curve point of the same seed (1.02)")
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "compression.json"))
    args = p.parse_args(argv)
    config, specs = MODELS[args.model]
    args.config = args.config or config
    args.train_compressors = split_specs(args.train_compressors or specs)
    return args


# ---- part A: one bucket, per call ------------------------------------------------------
def layer_shapes(count: int) -> list[tuple]:
    """(d, d), (d,) pairs, then a (rows, d) matrix and a vector for the rest: ``count`` float32."""
    d = 1024
    while d > 8 and d * d + d > count:
        d //= 2
    pairs = max(1, count // (d * d + d))
    rest = count - pairs * (d * d + d)
    tail = [(rest // d, d)] if rest >= d else []  # a matrix, so powersgd compresses the rest too
    return [(d, d), (d,)] * pairs + tail + ([(rest % d,)] if rest % d else [])


def validate(comm, MPI, np, make, spec, n, shapes, ctx) -> tuple[int, int, float]:
    """(#wrong against the closed form (exact compressors only), #ranks differing from rank 0, rel. error)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    pattern = np.arange(n) % PERIOD
    x = (pattern + rank).astype(np.float32)
    make(spec)(x, ctx, shapes)
    wrong = int(np.count_nonzero(x != size * pattern + size * (size - 1) / 2)) if spec in EXACT else 0
    g = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    exact = g.copy()
    comm.Allreduce(MPI.IN_PLACE, exact, op=MPI.SUM)
    y = make(spec)(g.copy(), ctx, shapes)
    differ = int(not np.array_equal(y, comm.bcast(y, root=0)))
    rel = float(np.linalg.norm(y - exact) / np.linalg.norm(exact))
    return comm.allreduce(wrong, op=MPI.SUM), comm.allreduce(differ, op=MPI.SUM), rel


def part_a(args) -> int:
    sys.path.insert(0, REPO)
    from hpctrain.runtime import limit_threads_per_rank

    limit_threads_per_rank()  # before numpy: one BLAS thread pool per core, not per rank
    import numpy as np
    from mpi4py import MPI

    from hpctrain.compress import Context, make_compressor
    from hpctrain.compress.reducer import CompressedSum

    comm = MPI.COMM_WORLD
    root, size, specs = comm.Get_rank() == 0, comm.Get_size(), split_specs(args.compressors)
    try:
        [make_compressor(s) for s in specs]  # unknown specs: one clear error before any work
        if args.mb <= 0 or args.repeats < 1 or args.warmup < 0:
            raise ValueError("--mb must be > 0, --repeats >= 1, --warmup >= 0")
    except ValueError as exc:  # the same verdict on every rank: print once, exit 2 everywhere
        if root:
            print(f"compression.py: error: {exc}", file=sys.stderr)
        return 2
    shapes = layer_shapes(int(args.mb * (1 << 20)) // 4)
    n = sum(int(np.prod(s)) for s in shapes)
    make = lambda spec: CompressedSum(comm, make_compressor(spec))  # noqa: E731
    checks = {s: validate(comm, MPI, np, make, s, n, shapes, Context(STEP, 0, 0)) for s in specs}
    reducers = {s: make(s) for s in specs}
    grad = np.random.default_rng(100 + comm.Get_rank()).standard_normal(n).astype(np.float32)
    buf = np.empty_like(grad)
    i = [0]  # the step of the next call: randk draws new indices, powersgd warm-starts
    calls = {s: (lambda s=s: reducers[s](buf, Context(STEP + i[0], 0, 0), shapes)) for s in specs}
    calls[YARDSTICK] = lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    names = list(calls)
    for _ in range(args.warmup):
        for name in names:
            buf[:] = grad
            calls[name]()
        i[0] += 1
    times = np.empty((len(names), args.repeats))
    codec = np.zeros((len(specs), args.repeats))  # encode_s + decode_s of this rank
    for r in range(args.repeats):
        for j, name in enumerate(names):
            buf[:] = grad  # a gradient, not the previous sum (outside the timed region)
            comm.Barrier()  # all start together: a late rank is not timed as a slow network
            t0 = MPI.Wtime()
            calls[name]()
            times[j, r] = MPI.Wtime() - t0
            if name in reducers:
                codec[j, r] = reducers[name].encode_s + reducers[name].decode_s
        i[0] += 1
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # once, after timing
    comm.Allreduce(MPI.IN_PLACE, codec, op=MPI.MAX)
    dense = 4 * n
    rows = []
    for j, name in enumerate(names):
        t = times[j]
        row = {"compressor": name, "ranks": size, "bytes": dense, "median_s": float(np.median(t)),
               "min_s": float(t.min()), "max_s": float(t.max()), "repeats": args.repeats}
        if name in reducers:
            red = reducers[name]
            c = float(np.median(codec[j]))
            row.update(sent_bytes=red.sent_bytes, dense_bytes=red.dense_bytes,
                       ratio=red.dense_bytes / red.sent_bytes if red.sent_bytes else None,
                       codec_s=c, codec_gbps=dense / c / 1e9 if c > 0 else None,
                       wrong=checks[name][0], differ=checks[name][1], rel_error=checks[name][2])
        else:
            row.update(sent_bytes=2 * (size - 1) * dense // size, wrong=0, differ=0, rel_error=0.0)
        rows.append(row)
    info = {"ranks": size, "shapes": [list(s) for s in shapes], "loadavg_1min": os.getloadavg()[0],
            "cores": os.cpu_count(), "mpi": MPI.Get_library_version().split("\0")[0].splitlines()[0].strip()}
    bad = sorted(r["compressor"] for r in rows if r["wrong"] or r["differ"])
    if root:
        print(table_a(rows, info, shapes))
        dump(args.json, {"part": "A", "info": info, "rows": rows})
        if bad:
            print(f"compression.py: FAIL: wrong or differing results from {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


def table_a(rows, info, shapes) -> str:
    mpi = next(r["median_s"] for r in rows if r["compressor"] == YARDSTICK)
    d = shapes[0][0]
    pairs = shapes.count((d, d))
    rest = "".join(f" + {'x'.join(map(str, s))}" for s in shapes[2 * pairs:])
    lines = [f"compressed sum of one {rows[0]['bytes'] / 2**20:.1f} MiB float32 bucket ({pairs} x ({d}x{d} + {d})"
             f"{rest}), {info['ranks']} rank(s); load average {info['loadavg_1min']:.1f} on "
             f"{info['cores']} cores", "",
             "| compressor | ratio | sent/rank MB | enc+dec GB/s | median ms | min ms | max ms | x MPI "
             "| rel. error | #wrong | #differ |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['compressor']} | {fmt(r.get('ratio'), '.1f')} | {r['sent_bytes'] / 1e6:.3f} | "
                     f"{fmt(r.get('codec_gbps'))} | {1e3 * r['median_s']:.2f} | {1e3 * r['min_s']:.2f} | "
                     f"{1e3 * r['max_s']:.2f} | {mpi / r['median_s']:.2f} | {r['rel_error']:.3g} | "
                     f"{r['wrong']} | {r['differ']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.train:
        from compression_train import part_b

        return part_b(args)
    return part_a(args)


if __name__ == "__main__":
    sys.exit(main())

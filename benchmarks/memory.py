"""Per-rank memory and step time of the GPT under ZeRO-1, 2 and 3 and activation recomputation.

    python benchmarks/memory.py                                   # examples/gpt.toml at 1 and 2 ranks
    python benchmarks/memory.py --ranks 1 2 4 --steps 20 --budget-gb 16 --json runs/bench/memory.json
    python benchmarks/memory.py --variants 0:none,0:blocks --steps 40 --repeats 5   # recomputation's cost only
    python benchmarks/memory.py --ranks 2 4 --precision bf16      # every run in bf16 (16-bit ZeRO-3 slots)

Part 1, measured: per world size, the example GPT (``--config``) trains ``--steps`` steps eight
ways, dist.zero 0/1/2/3 x model.recompute none/blocks (or the ``--variants`` given), with
dist.allreduce = ring and the same buckets for every variant (``--bucket-split``: by default
ZeRO-3's, one per layer unit; or ``size``, of ``--bucket-mb``, without zero 3). Ring's halves sum in the same order as its all-reduce, so with one micro-batch all the
runs must end on the same loss and the
same final parameters, bit for bit: checked before any time is reported. Per run: the computed
bytes per rank (parameters, gradients, optimizer state, activations of one micro-batch; exact,
from hpctrain.training.plan.planned_memory with the run's settings, and checked against the trainer's
start-up line, which rounds them to 10 kB), the measured peak
resident set (``peak_rss_mb`` of the metrics: rank 0's process), and the median step time
after the first ``--skip`` steps. Each row is compared with zero 0 / none at the same world
size, the yardstick of the same run.

Part 2, computed: the deepest GPT of GPT-2 small's proportions (d_model = 64 n_layer, 64-channel
heads; the config's context and micro-batch) whose computed bytes per rank (AdamW, float32) fit
``--budget-gb`` at the largest ``--ranks``, for each zero x recompute (buckets as the config has
them): the trainer's own accounting (``planned_memory``, on a device that allocates nothing), so the
model's ``activation_bytes`` and ZeRO's shares and slot plans do the counting.

``--precision`` (train.precision, fp32 by default) applies to every run and count: under bf16 or
fp16 zero 0-2 hold the float32 masters and a 16-bit compute copy of every parameter, zero 3 its
float32 chunks and 16-bit slots.

Part 3, computed: optimizer offload (``dist.offload = optimizer``) at each zero stage on a CUDA
device, counted on paper at the largest ``--ranks`` (no GPU needed to count; measuring its bytes and
step time needs one): the device's bytes with and without it, and the host's.

Targets (printed with each verdict): zero 1's optimizer state per rank = 1/N of zero 0's (to
one element per bucket: no padding); zero 1's step time within 5 % of zero 0's at 2 ranks;
recompute's activations at most 1/4 of none's, at most 35 % slower; zero 3's parameters, gradients
and optimizer state at most zero 0's / N plus two blocks' parameters, its step at most 1.3x zero
0's at 2 ranks, and its largest GPT at least 3x zero 0's parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
MEMORY = re.compile(r"memory per rank \(computed\): parameters ([\d,.]+) MB(?: \([^)]*\))?, gradients ([\d,.]+) MB"
                    r"(?: \([^)]*\))?, "
                    r"optimizer state ([\d,.]+) MB(?: \([^)]*\))?(?:, activations ([\d,.]+) MB)?")
VARIANTS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (0, "blocks"), (1, "blocks"), (2, "blocks"),
            (3, "blocks")]


def overrides(zero, recompute, args) -> list[str]:
    """The config settings of one variant's run (and of its planned bytes): everything but the
    run's own files."""
    return [f"train.steps={args.steps}", f"dist.zero={zero}", f"model.recompute={recompute}",
            f"train.precision={args.precision}",
            "dist.allreduce=ring", "train.eval_every=0", "data.eval=", "train.target_val_bpb=0",
            "train.target_bpb_vs_bigram=0", f"dist.bucket_split={args.bucket_split}", f"dist.bucket_mb={args.bucket_mb}",
            f"dist.first_bucket_mb={args.bucket_mb}"] + ([f"data.train={args.text}"] if args.text else [])


def run(ranks, zero, recompute, args, tmp) -> dict:
    metrics = os.path.join(tmp, f"m-{ranks}-{zero}-{recompute}.jsonl")
    ckpt = tempfile.mkdtemp(prefix=f"ck-{ranks}-{zero}-{recompute}-", dir=tmp)  # a fresh one per run
    sets = overrides(zero, recompute, args) + [
        f"train.metrics={metrics}", f"checkpoint.dir={ckpt}", "checkpoint.save_final=true",
        "checkpoint.every_minutes=0", "train.log_every=1000000"]
    cmd = ["mpirun", "-n", str(ranks), *args.mpirun_args.split(), sys.executable, "-m", "hpctrain", "train",
           "--config", args.config, *(x for kv in sets for x in ("--set", kv)), "--resume", ""]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"memory.py: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-3000:]}")
    m = MEMORY.search(done.stdout)
    if m is None:
        raise SystemExit(f"memory.py: no memory line in the output of {' '.join(cmd)}:\n{done.stdout[-2000:]}")
    # the trainer's line rounds to 10 kB; the table takes the same bytes computed exactly (rank 0's,
    # as the line's) and refuses a line that disagrees with them
    shown = [float(v.replace(",", "")) if v else float("nan") for v in m.groups()]
    params, grads, opt, acts = exact = _planned_mb(ranks, zero, recompute, args)
    if not all(abs(a - b) <= 0.005 + 1e-9 for a, b in zip(shown, exact) if not (math.isnan(a) and math.isnan(b))):
        raise SystemExit(f"memory.py: the trainer reported {shown} MB, the plan computes {exact} MB "
                         f"({ranks} ranks, zero {zero}, recompute {recompute})")
    records = [json.loads(line) for line in open(metrics)]
    steps = records[args.skip:] or records
    return {"ranks": ranks, "zero": zero, "recompute": recompute, "params_mb": params, "grads_mb": grads,
            "optimizer_mb": opt, "activations_mb": acts, "computed_mb": params + grads + opt + acts,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in records),
            "step_ms": 1e3 * statistics.median(r["step_time"] for r in steps),
            "final_loss": records[-1]["loss"], "final_params": _params_hash(ckpt, args.steps)}


def _planned_mb(ranks, zero, recompute, args) -> list[float]:
    """Rank 0's computed parameters, gradients, optimizer state and activations in MB (nan: not
    known), exact (hpctrain.training.plan.planned_memory, no allocation) for the run's config and overrides,
    read from REPO as the run reads them (relative data paths)."""
    import contextlib

    from hpctrain.training.config_load import load_config
    from hpctrain.training.plan import planned_memory
    from hpctrain.runtime import World

    with contextlib.chdir(REPO):
        cfg = load_config(args.config, overrides(zero, recompute, args)).validate()
        got = planned_memory(cfg, World(None, 0, ranks, None, 0, ranks, None, 0, 1))
    return [got[k] / 1e6 if got[k] is not None else float("nan")
            for k in ("params", "grads", "optimizer", "activations")]


def _params_hash(ckpt, step) -> str:
    """SHA-256 of the final checkpoint's parameters (after the last update, which no logged loss sees)."""
    import hashlib

    import h5py

    digest = hashlib.sha256()
    with h5py.File(os.path.join(ckpt, f"ckpt-{step:08d}.h5"), "r") as f:
        f["model"].visititems(lambda name, obj: digest.update(name.encode() + obj[()].tobytes())
                              if isinstance(obj, h5py.Dataset) else None)
    return digest.hexdigest()


def largest_within(budget_bytes, ranks, args) -> list[dict]:
    """Per zero x recompute, the deepest GPT of GPT-2 small's proportions (d_model = 64 n_layer,
    64-channel heads; 12 layers is d 768) whose computed bytes per rank fit the budget: rank 0's
    :func:`~hpctrain.training.plan.planned_memory` (the trainer's own accounting, on a device that
    allocates nothing) for the config with the run's overrides, buckets and micro-batch."""
    import contextlib

    from hpctrain.runtime import World
    from hpctrain.training.config_load import load_config
    from hpctrain.training.plan import planned_memory

    best = []
    world = World(None, 0, ranks, None, 0, ranks, None, 0, 1)
    for zero, recompute in VARIANTS:
        top = None
        for n_layer in range(1, 129):
            d = 64 * n_layer
            # the config's own buckets (part 1's small ones would cut a large model into thousands)
            sets = [x for x in overrides(zero, recompute, args) if not x.startswith(("dist.bucket_mb",
                                                                                     "dist.first_bucket_mb",
                                                                                     "dist.bucket_split"))]
            sets += [f"model.n_layer={n_layer}", f"model.d_model={d}",
                                                       f"model.n_head={n_layer}", "train.device=cpu"]
            with contextlib.chdir(REPO):
                cfg = load_config(args.config, sets).validate()
                got = planned_memory(cfg, world)
            total = got["params"] + got["grads"] + got["optimizer"] + got["activations"]
            if total > budget_bytes:
                break
            top = {"zero": zero, "recompute": recompute, "d_model": d, "n_layer": n_layer,
                   "parameters": _parameters(n_layer, d, cfg.model.context), "bytes_per_rank": total,
                   "states_bytes": got["params"] + got["grads"] + got["optimizer"]}
        best.append(top)
    return best


def offload_rows(ranks, args) -> list[dict]:
    """Part 3, computed: the config on a CUDA device (``train.device = cuda``, on paper: no GPU is
    needed to count) at each zero stage, with ``dist.offload`` none and optimizer: rank 0's bytes on
    the device and in host memory, by the trainer's own accounting."""
    import contextlib

    from hpctrain.runtime import World
    from hpctrain.training.config_load import load_config
    from hpctrain.training.plan import planned_memory

    world = World(None, 0, ranks, None, 0, ranks, None, 0, 1)
    rows = []
    for zero in (0, 1, 2, 3):
        for offload in ("none", "optimizer"):
            sets = overrides(zero, "none", args) + ["train.device=cuda", f"dist.offload={offload}"]
            with contextlib.chdir(REPO):
                got = planned_memory(load_config(args.config, sets).validate(), world)
            rows.append({"ranks": ranks, "zero": zero, "offload": offload, "params": got["params"],
                         "grads": got["grads"], "optimizer": got["optimizer"], "host_state": got["host_state"],
                         "host": got["host"], "device_states": got["params"] + got["grads"] + got["optimizer"]})
    return rows


def _parameters(n_layer: int, d: int, context: int, vocab: int = 256) -> int:
    """A GPT's parameter count (byte vocabulary, tied head): (V + T) C + L (12 C^2 + 13 C) + 2 C."""
    return (vocab + context) * d + n_layer * (12 * d * d + 13 * d) + 2 * d


def print_offload(offload, ranks, args) -> None:
    """Part 3's table."""
    print(f"\nOptimizer offload (dist.offload = optimizer), computed for a CUDA device at {ranks} rank(s), "
          f"{args.config}, train.precision {args.precision}, recompute none (measuring needs a GPU): parameters, gradients and optimizer state "
          f"per rank on the device, and in host memory\n")
    print("| zero | offload | params MB | grads MB | optimizer MB (device) | device MB | vs no offload | "
          "host state MB | host MB (state, masters, gradients) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    kept = {r["zero"]: r["device_states"] for r in offload if r["offload"] == "none"}
    for r in offload:
        print(f"| {r['zero']} | {r['offload']} | {r['params'] / 1e6:.2f} | {r['grads'] / 1e6:.2f} | "
              f"{r['optimizer'] / 1e6:.2f} | {r['device_states'] / 1e6:.2f} | "
              f"{r['device_states'] / kept[r['zero']]:.3f} | {r['host_state'] / 1e6:.2f} | {r['host'] / 1e6:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/gpt.toml")
    p.add_argument("--text", default="", help="the token file (default: the config's data.train)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant (alternating); the median is shown")
    p.add_argument("--variants", default=",".join(f"{z}:{r}" for z, r in VARIANTS),
                   help="ZERO:RECOMPUTE pairs to run, 0:none first (the yardstick); default: all six")
    p.add_argument("--budget-gb", type=float, default=8.0, help="per-rank memory budget for part 2")
    p.add_argument("--bucket-split", default="layers", choices=["layers", "size"],
                   help="dist.bucket_split of every part 1 run: layers (ZeRO-3's buckets, so every variant adds "
                        "alike) or size (--bucket-mb; without zero 3 variants)")
    p.add_argument("--bucket-mb", type=float, default=0.25,
                   help="dist.bucket_mb (and first_bucket_mb) of part 1 with --bucket-split size")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="train.precision of every run and count")
    p.add_argument("--mpirun-args", default="--oversubscribe")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default="runs/bench/memory.json")
    args = p.parse_args()
    from hpctrain.training.config_load import load_config

    variants = []
    for v in args.variants.split(","):
        zero, _, recompute = v.strip().partition(":")
        if not zero.isdigit() or recompute not in ("none", "blocks"):
            p.error(f"--variants: {v!r} is not ZERO:RECOMPUTE (e.g. 0:none,0:blocks)")
        variants.append((int(zero), recompute))
    if variants[0] != (0, "none"):
        p.error("--variants: the first must be 0:none, the yardstick every ratio is read against")
    if args.bucket_split == "size" and any(z == 3 for z, _ in variants):
        p.error("--bucket-split size: zero 3 gathers layer buckets; leave the 3:* variants out, or use layers")
    cfg = load_config(os.path.join(REPO, args.config))
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpctrain-memory-") as tmp:
        for ranks in args.ranks:
            # the variants alternate, --repeats times: a noisy machine's drift hits them alike
            tries = [[run(ranks, z, r, args, tmp) for z, r in variants] for _ in range(args.repeats)]
            got = []
            for i in range(len(variants)):
                mine = [t[i] for t in tries]
                steps = sorted(m["step_ms"] for m in mine)
                got.append(dict(mine[0], step_ms=statistics.median(steps), step_ms_min=steps[0],
                                step_ms_max=steps[-1], ends={(m["final_loss"], m["final_params"]) for m in mine}))
            ends = set().union(*(g.pop("ends") for g in got))
            if len(ends) != 1:  # validate before timing: the variants must train alike, to the last update
                raise SystemExit(f"memory.py: at {ranks} rank(s) the variants ended on different losses or "
                                 f"parameters: {sorted(ends)}")
            base = got[0]
            for g in got:
                g["optimizer_vs_zero0"] = g["optimizer_mb"] / base["optimizer_mb"]
                g["grads_vs_zero0"] = g["grads_mb"] / base["grads_mb"]
                g["activations_vs_none"] = g["activations_mb"] / base["activations_mb"]
                g["step_vs_baseline"] = g["step_ms"] / base["step_ms"]
            rows += got
    print(f"\nPer-rank memory and step time, {args.config} ({platform.node()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; train.precision {args.precision}; {args.steps} steps, median after "
          f"{args.skip}, median of {args.repeats} "
          f"alternating runs (range in brackets); dist.allreduce ring, "
          f"{'layer buckets' if args.bucket_split == 'layers' else f'buckets of {args.bucket_mb:g} MB'}; every "
          f"variant ended on the same loss and parameters):\n")
    print("| ranks | zero | recompute | params MB | grads MB | optimizer MB | activations MB | computed MB | "
          "peak RSS MB | step ms | optimizer / zero 0 | activations / none | step / baseline |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for g in rows:
        print(f"| {g['ranks']} | {g['zero']} | {g['recompute']} | {g['params_mb']:.2f} | {g['grads_mb']:.2f} | "
              f"{g['optimizer_mb']:.2f} | {g['activations_mb']:.2f} | {g['computed_mb']:.2f} | "
              f"{g['peak_rss_mb']:.0f} | {g['step_ms']:.1f} [{g['step_ms_min']:.0f}-{g['step_ms_max']:.0f}] | "
              f"{g['optimizer_vs_zero0']:.3f} | "
              f"{g['activations_vs_none']:.3f} | {g['step_vs_baseline']:.3f} |")
    print("\nTargets:")
    for g in rows:
        if g["zero"] == 1 and g["recompute"] == "none":
            n = g["ranks"]
            print(f"  zero 1 optimizer state at {n} rank(s): {g['optimizer_vs_zero0']:.4f} of zero 0 (1/{n} = "
                  f"{1 / n:.4f}): {'met' if abs(g['optimizer_vs_zero0'] - 1 / n) < 1e-3 else 'NOT met'}")
            if n == 2:
                print(f"  zero 1 step time at 2 ranks: {g['step_vs_baseline']:.3f} of zero 0 (target <= 1.05): "
                      f"{'met' if g['step_vs_baseline'] <= 1.05 else 'NOT met'}")
        if g["zero"] == 2 and g["recompute"] == "none":
            print(f"  zero 2 gradients at {g['ranks']} rank(s): {g['grads_vs_zero0']:.3f} of zero 0 (the reused "
                  f"slots + 1/{g['ranks']}); step {g['step_vs_baseline']:.3f} of zero 0")
        if g["zero"] == 3 and g["recompute"] == "none":
            n, base = g["ranks"], next(b for b in rows if b["ranks"] == g["ranks"] and b["zero"] == 0
                                        and b["recompute"] == "none")
            C = cfg.model.d_model
            blocks_mb = 2 * (12 * C * C + 13 * C) * 4 / 1e6   # two blocks' float32 parameters
            states = g["params_mb"] + g["grads_mb"] + g["optimizer_mb"]
            bound = (base["params_mb"] + base["grads_mb"] + base["optimizer_mb"]) / n + blocks_mb
            print(f"  zero 3 at {n} rank(s): parameters + gradients + optimizer state {states:.2f} MB against zero "
                  f"0's / {n} + two blocks' parameters = {bound:.2f} MB: {'met' if states <= bound else 'NOT met'}; "
                  f"step {g['step_vs_baseline']:.3f} of zero 0" + (f" (target <= 1.3: "
                  f"{'met' if g['step_vs_baseline'] <= 1.3 else 'NOT met'})" if n == 2 else ""))
        if g["zero"] == 0 and g["recompute"] == "blocks":
            print(f"  recompute at {g['ranks']} rank(s): activations {g['activations_vs_none']:.3f} of none (target "
                  f"<= 0.25: {'met' if g['activations_vs_none'] <= 0.25 else 'NOT met'}), step "
                  f"{g['step_vs_baseline']:.3f} (target <= 1.35: {'met' if g['step_vs_baseline'] <= 1.35 else 'NOT met'})")
    largest = largest_within(args.budget_gb * 1e9, max(args.ranks), args)
    print(f"\nThe deepest GPT of GPT-2 small's proportions (d_model = 64 n_layer) whose computed bytes fit "
          f"{args.budget_gb:g} GB per rank at {max(args.ranks)} rank(s) (train.precision {args.precision}, AdamW, "
          f"context {cfg.model.context}, "
          f"the config's micro-batch; CPU attention, which keeps T x T):\n")
    print("| zero | recompute | d_model | n_layer | parameters | vs zero 0 | GB per rank | of which parameters, "
          "gradients and optimizer state |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    zero0 = {t["recompute"]: t["parameters"] for t in largest if t is not None and t["zero"] == 0}
    for t in largest:
        if t is None:
            continue
        vs = t["parameters"] / zero0[t["recompute"]] if zero0.get(t["recompute"]) else float("nan")
        print(f"| {t['zero']} | {t['recompute']} | {t['d_model']} | {t['n_layer']} | {t['parameters']:,} | "
              f"{vs:.2f}x | {t['bytes_per_rank'] / 1e9:.2f} | {t['states_bytes'] / 1e9:.2f} |")
    for t in largest:
        if t is not None and t["zero"] == 3 and t["recompute"] == "blocks" and zero0.get("blocks"):
            vs = t["parameters"] / zero0["blocks"]
            print(f"\n  zero 3's largest GPT at {max(args.ranks)} rank(s): {vs:.2f}x zero 0's parameters (target >= 3 "
                  f"at 4 ranks: {'met' if vs >= 3 else 'NOT met'})")
    offload = offload_rows(max(args.ranks), args)
    print_offload(offload, max(args.ranks), args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": platform.node(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                   "config": args.config, "steps": args.steps, "runs": rows, "largest": largest,
                   "offload": offload, "budget_gb": args.budget_gb, "precision": args.precision}, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

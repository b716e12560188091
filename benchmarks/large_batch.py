"""LAMB and LARS against AdamW at large global batches, at equal tokens, on the example GPT.

    python benchmarks/large_batch.py                                   # 8x and 32x, 2^21 tokens each, ~20 min here
    python benchmarks/large_batch.py --multiples 1 8 32 --tokens 4194304 --json runs/bench/large_batch.json

For each batch multiple k (the example's global batch of 32 windows times k) and each optimizer, one
rank trains the example GPT (examples/gpt.toml) on ``--tokens`` tokens in this process: steps =
tokens / (32 k x 128), the learning rate by the linear scaling rule (the optimizer's base rate at
the base batch of 32, times k), warmup a tenth of the steps, then cosine to a tenth of the peak,
as the example schedules it; k micro-batches of 32 windows per step (the example's activation
memory). Base rates: AdamW and LAMB 3e-3 (the example's), LARS 0.5 (its trust
coefficient 0.001 makes a step lr x 0.001 of each weight's norm). Four evaluations on 65,536
validation tokens along the way and the whole /val split at the end. Reported: the final validation
loss per run and, per multiple, LAMB's and LARS's against AdamW's; the target is LAMB's final loss
<= AdamW's at 32x. Validation first: a run whose loss ends non-finite is reported as diverged (a
result at that learning rate, not a failure of the benchmark). ``--plot`` draws validation loss
against tokens (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BASE_BATCH, CONTEXT = 32, 128
BASE_LR = {"adamw": 3e-3, "lamb": 3e-3, "lars": 0.5}


def train_once(optim: str, k: int, tokens: int, out: str, config: str) -> dict:
    """One in-process run on COMM_SELF: validation losses along the way and at the end."""
    from mpi4py import MPI

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.config_load import load_config
    from hpctrain.training.trainer import Trainer

    batch = BASE_BATCH * k
    steps = max(1, tokens // (batch * CONTEXT))
    peak = BASE_LR[optim] * k
    # the scaling rule applied here (as optim.scale_lr would), so the run's config shows the rate it trains at
    sets = [f'optim.name="{optim}"', f"optim.lr={peak}", "optim.scale_lr=false",
            f"optim.warmup_steps={max(1, steps // 10)}", f"optim.min_lr={peak / 10}", f"train.global_batch={batch}",
            f"train.grad_accum_steps={k}", f"train.steps={steps}", "train.device=\"cpu\"", f"train.eval_every={max(1, steps // 4)}",
            "train.eval_tokens=65536", "train.target_bpb_vs_bigram=0",
            f"train.metrics={json.dumps(os.path.join(out, 'metrics.jsonl'))}", "guard.nonfinite=\"skip\"",
            "guard.max_bad_steps=1000000", f"checkpoint.dir={json.dumps(os.path.join(out, 'ckpt'))}",
            "checkpoint.every_minutes=0", "checkpoint.save_final=false", "train.log_every=1000000"]
    cfg = load_config(os.path.join(REPO, config), sets)
    trainer = Trainer(cfg, init_world(MPI.COMM_SELF), Log(False))
    try:
        result = trainer.run()
    finally:
        trainer.close()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    curve = [(r["step"] * batch * CONTEXT, r["val_loss"]) for r in records if "val_loss" in r]
    final = result["eval"]["loss"] if result.get("eval") else float("nan")
    return {"optim": optim, "multiple": k, "global_batch": batch, "steps": steps, "peak_lr": peak,
            "tokens": steps * batch * CONTEXT, "val_loss": final, "curve": curve, "bad_steps": result["bad_steps"],
            "tokens_per_s": result["tokens_per_s"]}


def plot(runs, path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot (matplotlib is not installed)"
    fig, axes = plt.subplots(1, len({r["multiple"] for r in runs}), figsize=(11, 4), squeeze=False)
    for ax, k in zip(axes[0], sorted({r["multiple"] for r in runs})):
        for r in (r for r in runs if r["multiple"] == k):
            xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
            ax.plot([x / 1e6 for x in xs], ys, marker="o", label=f"{r['optim']} (lr {r['peak_lr']:g})")
        ax.set_title(f"global batch {BASE_BATCH * k} ({k}x)")
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("validation loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/gpt.toml")
    ap.add_argument("--multiples", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "lamb", "lars"], choices=sorted(BASE_LR))
    ap.add_argument("--tokens", type=int, default=2 ** 21)
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="", help="a PNG path for validation loss against tokens")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.multiples:
            for optim in args.optimizers:
                out = os.path.join(tmp, f"{optim}-{k}")
                os.makedirs(out)
                runs.append(train_once(optim, k, args.tokens, out, args.config))
                r = runs[-1]
                print(f"  {k}x {optim}: {r['steps']} steps at lr {r['peak_lr']:g}, val loss {r['val_loss']:.4f}",
                      flush=True)
    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))
    print(f"\n{args.config}'s GPT, {args.tokens:,} tokens per run, 1 rank, {threads} thread(s), "
          f"{platform.processor() or platform.machine()}")
    print("| global batch | optimizer | steps | peak lr | final val loss | vs AdamW | skipped steps |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    by = {(r["multiple"], r["optim"]): r for r in runs}
    for r in runs:
        base = by.get((r["multiple"], "adamw"))
        vs = "-" if base is None or r["optim"] == "adamw" or not math.isfinite(base["val_loss"]) else \
            f"{r['val_loss'] - base['val_loss']:+.4f}"
        loss = f"{r['val_loss']:.4f}" if math.isfinite(r["val_loss"]) else "diverged"
        print(f"| {r['global_batch']} ({r['multiple']}x) | {r['optim']} | {r['steps']} | {r['peak_lr']:g} | {loss} | "
              f"{vs} | {r['bad_steps']} |")
    target = by.get((32, "lamb")), by.get((32, "adamw"))
    if all(target):
        met = target[0]["val_loss"] <= target[1]["val_loss"] or not math.isfinite(target[1]["val_loss"])
        print(f"target: LAMB's final validation loss <= AdamW's at 32x: {'met' if met else 'NOT met'} "
              f"({target[0]['val_loss']:.4f} against {target[1]['val_loss']:.4f})")
    if args.plot:
        print(f"plot: {plot(runs, args.plot)}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "tokens": args.tokens, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

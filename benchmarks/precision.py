"""train.precision on the CPU: bf16 and fp16 against fp32 on the same GPT, data and steps.

    python benchmarks/precision.py                                  # examples/gpt.toml, 3 seeds, 200 steps
    python benchmarks/precision.py --steps 400 --seeds 0 1 2 --json runs/bench/precision.json

For each seed (the initial weights; the data order is the config's) and each precision, one rank
trains ``--steps`` steps of the config's GPT (``train.precision`` = fp32, bf16, fp16) in this
process and scores the whole /val split at the end. Reported per precision: the final validation
loss against fp32's of the same seed (target: bf16 within 2 %), tokens/s (median over seeds),
the activation bytes of one micro-batch (computed by the model, which a test checks against the
arrays its layers hold) and the float32 work arrays a 16-bit model's conversions hold after
training (not counted in the activations). (The process's peak resident set is not reported: the
runs share one process.) Validation first:
each run's final loss must be finite and every fp32 run must learn (loss below its first step's),
or the row says FAILED and the exit code is 1.

The CPU run of a 16-bit precision is its correctness path: every op converts its 16-bit operands
to float32 and back (hpctrain/device/mixed.py), so it is slower than fp32 here, and the tokens/s are
stated, not targeted. The speed targets of bf16 are a GPU's (tensor-core GEMMs), measured by
scripts/gpu-check.sh when a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PRECISIONS = ("fp32", "bf16", "fp16")


def train_once(config: str, precision: str, seed: int, steps: int, out: str) -> dict:
    """One in-process run on COMM_SELF: final validation loss, tokens/s, activation bytes, peak RSS."""
    from mpi4py import MPI

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.config_load import load_config
    from hpctrain.training.trainer import Trainer

    sets = [f"train.precision={json.dumps(precision)}", f"train.seed={seed}", f"train.steps={steps}",
            "train.device=\"cpu\"", "train.eval_every=0", "train.target_bpb_vs_bigram=0",
            f"train.metrics={json.dumps(os.path.join(out, 'metrics.jsonl'))}",
            f"checkpoint.dir={json.dumps(os.path.join(out, 'ckpt'))}", "checkpoint.every_minutes=0",
            "checkpoint.save_final=false", "train.log_every=1000000"]
    cfg = load_config(os.path.join(REPO, config), sets)
    trainer = Trainer(cfg, init_world(MPI.COMM_SELF), Log(False))
    try:
        rows = -(-cfg.train.global_batch // cfg.train.grad_accum_steps)
        activations = trainer.model.activation_bytes(rows)
        result = trainer.run()
        # a 16-bit model's float32 work arrays (hpctrain.device.mixed.MixedDevice), after training
        work = getattr(trainer.model.device, "work_bytes", lambda: 0)()
    finally:
        trainer.close()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        first = json.loads(f.readline())["loss"]
    return {"precision": precision, "seed": seed, "val_loss": result["eval"]["loss"], "first_loss": first,
            "tokens_per_s": result["tokens_per_s"], "activation_bytes": activations, "work_bytes": work}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/gpt.toml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for p in args.precisions:
                out = os.path.join(tmp, f"{p}-{seed}")
                os.makedirs(out)
                runs.append(train_once(args.config, p, seed, args.steps, out))
                r = runs[-1]
                print(f"  seed {seed} {p}: val loss {r['val_loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s",
                      flush=True)
    ok = all(r["val_loss"] == r["val_loss"] and abs(r["val_loss"]) != float("inf") for r in runs)
    ok &= all(r["val_loss"] < r["first_loss"] for r in runs if r["precision"] == "fp32")
    fp32 = {r["seed"]: r for r in runs if r["precision"] == "fp32"}
    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))
    print(f"\n{args.config}, {args.steps} steps, seeds {args.seeds}, 1 rank, {threads} thread(s), "
          f"{platform.processor() or platform.machine()}")
    print("| precision | val loss per seed | vs fp32 (worst) | tokens/s (median) | activations MB | conversion work "
          "MB |")
    print("|---|---|---:|---:|---:|---:|")
    table = {}
    for p in args.precisions:
        mine = [r for r in runs if r["precision"] == p]
        ratio = max((abs(r["val_loss"] / fp32[r["seed"]]["val_loss"] - 1) for r in mine if r["seed"] in fp32),
                    default=None)
        table[p] = {"val_loss": [r["val_loss"] for r in mine], "worst_vs_fp32": ratio,
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                    "activation_bytes": mine[0]["activation_bytes"], "work_bytes": mine[0]["work_bytes"]}
        t = table[p]
        vs = "-" if ratio is None or p == "fp32" else f"{100 * ratio:.2f} %"
        print(f"| {p} | {', '.join(f'{v:.4f}' for v in t['val_loss'])} | {vs} | {t['tokens_per_s']:,.0f} | "
              f"{t['activation_bytes'] / 1e6:,.2f} | {t['work_bytes'] / 1e6:,.2f} |")
    if "bf16" in table and table["bf16"]["worst_vs_fp32"] is not None:
        met = table["bf16"]["worst_vs_fp32"] <= 0.02
        print(f"target: bf16's validation loss within 2 % of fp32's at equal steps: "
              f"{'met' if met else 'NOT met'} ({100 * table['bf16']['worst_vs_fp32']:.2f} % at worst)")
    if not ok:
        print("FAILED: a run ended non-finite, or an fp32 run did not learn")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "steps": args.steps, "seeds": args.seeds, "runs": runs,
                       "table": table, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Part B of benchmarks/compression.py: training runs per compressor and seed, time to a target loss.

Each spec ``COMPRESSOR[+momentum][@SCOPE][:STEPS]`` (``topk(0.01)``, ``fp16@inter``,
``powersgd(4)+momentum:1200``) is trained once per ``--seeds`` seed with ``python -m hpctrain train
--config CONFIG`` through ``--launcher`` (plain ``mpirun``, or ``benchmarks/emulated_cluster.sh ...
--`` for two nodes over a capped link). ``+momentum`` sets ``dist.compress_momentum=true`` (momentum
correction); ``@inter`` sets ``dist.allreduce=hierarchical`` and ``dist.compress_scope=inter``;
``:STEPS`` sets ``train.steps`` (the same wall-clock can buy a compressed run more steps).

The loss curve of a run comes from its per-step metrics: for a language model (``[model] kind =
"gpt"``) its validation loss at every ``train.eval_every`` step before the last (each on the same
``train.eval_tokens`` subset of /val); for the MLP the training loss smoothed over ``--window``
steps. The x axes are the step and the seconds of training up to it (the sum of ``step_time``:
start-up and evaluations not counted). Per run: the final loss (the GPT's: the last step's, on the
whole /val split; the MLP's: the curve's last point); the target, ``--target-factor`` x the last
curve point of the uncompressed (``none``) run of the same seed (or ``--target-loss``), so that
curve and target come from the same evaluation set; the first curve point at or below it, in
steps and seconds. Per spec, over seeds: the mean final loss, its ratio to none's mean (a quality
comparison at equal steps only when the steps are equal), the mean seconds to the target when
every seed reached it, and the speed-up none's mean / this mean.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"emulated cluster: link bytes \S+ (\d+), \S+ (\d+)")


def parse_spec(spec: str) -> tuple[str, str, int | None, bool]:
    """'powersgd(4)+momentum@inter:1200' -> ('powersgd(4)', 'inter', 1200, True); scope '', steps
    None and momentum False when absent."""
    rest, _, steps = spec.partition(":")  # no compressor spec holds a ':'
    rest, _, scope = rest.partition("@")
    comp, plus, flag = rest.partition("+")
    if steps and not steps.isdigit():
        raise ValueError(f"spec {spec!r}: the steps after ':' must be a whole number")
    if plus and flag != "momentum":
        raise ValueError(f"spec {spec!r}: the only flag after '+' is 'momentum' (COMPRESSOR[+momentum][@SCOPE][:STEPS])")
    if scope not in ("", "all", "inter"):
        raise ValueError(f"spec {spec!r}: the scope after '@' is all or inter (COMPRESSOR[+momentum][@SCOPE][:STEPS])")
    return comp, scope, int(steps) if steps else None, bool(plus)


def spec_sets(spec: str) -> list[str]:
    """The --set overrides a spec stands for (its compressor, scope, steps, momentum correction)."""
    comp, scope, steps, momentum = parse_spec(spec)
    sets = [f'dist.compress="{comp}"']
    if scope:
        sets += ['dist.allreduce="hierarchical"', f'dist.compress_scope="{scope}"']
    if steps:
        sets.append(f"train.steps={steps}")
    if momentum:
        sets.append("dist.compress_momentum=true")
    return sets


def run_training(args, spec: str, seed: int, out_dir: str) -> dict:
    """One training run; its metrics, exit status, and what the launcher and the run printed."""
    comp, scope, _, momentum = parse_spec(spec)
    name = re.sub(r"[^a-z0-9.]+", "_", spec.replace("@", "-at-").replace(":", "-steps-").replace("+", "-plus-")) \
        + f"-seed{seed}"
    path = os.path.join(out_dir, name + ".jsonl")
    if os.path.exists(path):
        os.remove(path)  # a metrics file is appended to only on resume; start clean
    sets = [f'train.metrics="{path}"', f"train.seed={seed}",
            "train.target_accuracy=0", "train.target_val_bpb=0", "train.target_bpb_vs_bigram=0",
            f'checkpoint.dir="{os.path.join(out_dir, "ckpt-" + name)}"', "checkpoint.every_minutes=0",
            "checkpoint.save_final=false", *args.set, *spec_sets(spec)]
    cmd = shlex.split(args.launcher) + [sys.executable, "-m", "hpctrain", "train", "--config", args.config]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    text = proc.stdout + proc.stderr
    m = re.search(r"(\d+) rank\(s\) on (\d+) node", text)
    link = LINK.findall(text)
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return {"spec": spec, "compressor": comp + ("+momentum" if momentum else ""), "scope": scope or "all", "seed": seed, "rc": proc.returncode,
            "wall_s": wall, "metrics": path, "steps": rows,
            "ranks": int(m.group(1)) if m else None, "nodes": int(m.group(2)) if m else None,
            "link_bytes": sum(map(int, link[-1])) if link else None,
            "accuracy": (re.findall(r"accuracy[^\d]*([\d.]+)\s*%", text) or [None])[-1],
            "tail": text[-1500:] if proc.returncode else ""}


def curve(rows: list[dict], window: int, val: bool) -> list[list[float]]:
    """[step, seconds of training up to it, loss] points: the validation loss of each evaluation
    during training (``val``; not the last step's, which scores the whole split where the others
    score the same subset), else the training loss smoothed over ``window`` steps (a point per step
    once the window fills)."""
    seconds, out, recent = 0.0, [], []
    for r in rows[:-1] if val else rows:
        seconds += r["step_time"]
        if val:
            if "val_loss" in r:
                out.append([r["step"], seconds, r["val_loss"]])
            continue
        recent.append(r["loss"])
        if len(recent) > window:
            recent.pop(0)
        if len(recent) == window:
            out.append([r["step"], seconds, sum(recent) / window])
    return out


def summarise(run: dict, window: int, val: bool, start_step: int) -> dict:
    """A run's row: its curve, final loss, bytes (per step at the end, and over the run), and the
    median codec and step times of the steps from ``start_step`` on (compression's, once warm)."""
    st = run.pop("steps")
    p = run["ranks"] or 1
    sent = [s.get("bytes_sent", 2 * (p - 1) * s["bytes_reduced"] // p) for s in st]
    dense = [s.get("bytes_dense", x) for s, x in zip(st, sent)]
    warm = [s for s in st if s["step"] > start_step] or st  # metrics count steps from 1
    points = curve(st, window, val)
    final = st[-1].get("val_loss") if val and st else points[-1][2] if points else None
    return dict(run, n_steps=len(st), curve=points, final_loss=final,
                train_s=sum(s["step_time"] for s in st), bytes_sent=int(sum(sent)), bytes_dense=int(sum(dense)),
                step_sent_bytes=sent[-1] if st else None, step_dense_bytes=dense[-1] if st else None,
                codec_ms=statistics.median(1e3 * (s.get("encode_time", 0.0) + s.get("decode_time", 0.0))
                                           for s in warm) if st else None,
                step_ms=1e3 * statistics.median(s["step_time"] for s in warm) if st else None)


def time_to(points, target):
    """(step, seconds) of the first curve point at or below ``target``, else (None, None)."""
    hit = next((pt for pt in points if target is not None and pt[2] <= target), None)
    return (hit[0], hit[1]) if hit else (None, None)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def aggregate(runs: list[dict], target_loss: float, factor: float) -> list[dict]:
    """Per spec over its seeds; also sets each run's target, steps and seconds to it, and x none."""
    base = {r["seed"]: r["final_loss"] for r in runs if r["spec"] == "none"}
    ends = {r["seed"]: r["curve"][-1][2] for r in runs if r["spec"] == "none" and r["curve"]}
    for r in runs:
        r["target"] = target_loss or (factor * ends[r["seed"]] if ends.get(r["seed"]) else None)
        r["target_step"], r["target_s"] = time_to(r["curve"], r["target"])
        b = base.get(r["seed"])
        r["loss_vs_none"] = r["final_loss"] / b if b and r["final_loss"] else None
    out = []
    for spec in dict.fromkeys(r["spec"] for r in runs):
        sel = [r for r in runs if r["spec"] == spec]
        losses = [r["final_loss"] for r in sel if r["final_loss"] is not None]
        reached = [r["target_s"] for r in sel if r["target_s"] is not None]
        out.append({"spec": spec, "compressor": sel[0]["compressor"], "scope": sel[0]["scope"],
                    "seeds": [r["seed"] for r in sel], "n_steps": max(r["n_steps"] for r in sel),
                    "ranks": sel[0]["ranks"], "nodes": sel[0]["nodes"],
                    "final_loss": _mean(losses), "final_min": min(losses, default=None),
                    "final_max": max(losses, default=None),
                    "step_sent_mb": _mean([r["step_sent_bytes"] / 1e6 for r in sel if r["step_sent_bytes"]]),
                    "step_ratio": _mean([r["step_dense_bytes"] / r["step_sent_bytes"] for r in sel
                                         if r["step_sent_bytes"]]),
                    "run_ratio": _mean([r["bytes_dense"] / r["bytes_sent"] for r in sel if r["bytes_sent"]]),
                    "codec_ms": _mean([r["codec_ms"] for r in sel]), "step_ms": _mean([r["step_ms"] for r in sel]),
                    "train_s": _mean([r["train_s"] for r in sel]),
                    "reached": len(reached),  # steps and seconds: means when every seed reached it
                    "target_step": _mean([r["target_step"] for r in sel]) if len(reached) == len(sel) else None,
                    "target_s": _mean(reached) if len(reached) == len(sel) else None,
                    "link_mb": _mean([r["link_bytes"] / 1e6 for r in sel if r["link_bytes"] is not None]),
                    "accuracy": _mean([float(r["accuracy"]) for r in sel if r["accuracy"]]),
                    "rc": max(r["rc"] for r in sel)})
    none = next((s for s in out if s["spec"] == "none"), None)
    for s in out:
        s["loss_vs_none"] = s["final_loss"] / none["final_loss"] if none and none["final_loss"] and \
            s["final_loss"] else None
        s["speedup"] = none["target_s"] / s["target_s"] if none and none["target_s"] and s["target_s"] else None
    return out


def baseline_runs(path: str, seeds) -> dict:
    """seed -> the uncompressed run of an earlier part B JSON (``--baseline``), its curve and numbers
    as they were; the caller states the same config and launcher."""
    doc = json.load(open(path))
    found = {r["seed"]: {k: v for k, v in r.items() if k not in ("target", "target_step", "target_s",
                                                                     "loss_vs_none")}
             for r in doc["rows"] if r["spec"] == "none" and r["seed"] in seeds}
    if set(found) != set(seeds):
        raise SystemExit(f"compression.py: error: --baseline {path} has no uncompressed run for seed(s) "
                         f"{sorted(set(seeds) - set(found))}")
    return found


def part_b(args) -> int:
    from compression_report import dump, plot_curves, table_b

    sys.path.insert(0, REPO)
    from hpctrain.training.config_load import load_config
    from hpctrain.errors import ConfigError

    specs = args.train_compressors
    try:
        for spec in specs:  # every run's config, checked before any starts
            try:
                load_config(os.path.join(REPO, args.config), [*args.set, *spec_sets(spec)])
            except ConfigError as exc:
                raise ConfigError(f"spec {spec!r}: {exc}") from None
        cfg = load_config(os.path.join(REPO, args.config), args.set)  # what every run starts from
    except (ValueError, ConfigError) as exc:
        print(f"compression.py: error: {exc}", file=sys.stderr)
        return 2
    val = cfg.model.kind == "gpt"
    if not args.target_loss and "none" not in specs:
        print("compression.py: error: --target-loss 0 needs 'none' in --train-compressors", file=sys.stderr)
        return 2
    # beside the JSON and named after it: two benchmarks writing beside each other keep their runs
    out_dir = os.path.splitext(os.path.abspath(args.json))[0] + "-metrics"
    os.makedirs(out_dir, exist_ok=True)
    load0, runs = os.getloadavg()[0], []
    reused = baseline_runs(args.baseline, args.seeds) if args.baseline else {}
    for seed in args.seeds:
        for spec in specs:
            if spec == "none" and seed in reused:
                runs.append(reused[seed])
                continue
            print(f"training with {spec}, seed {seed} ...", file=sys.stderr, flush=True)
            run = summarise(run_training(args, spec, seed, out_dir), args.window, val, cfg.dist.compress_start_step)
            runs.append(run)
            if run["rc"]:
                print(f"  exit {run['rc']}:\n{run['tail']}", file=sys.stderr)
    summary = aggregate(runs, args.target_loss, args.target_factor)
    m = cfg.model
    info = {"launcher": args.launcher, "config": args.config, "baseline": args.baseline,
            "model": {"kind": m.kind, "n_layer": m.n_layer, "n_head": m.n_head, "d_model": m.d_model,
                      "context": m.context} if val else {"kind": m.kind, "hidden": list(m.hidden)},
            "compress_start_step": cfg.dist.compress_start_step, "freeze_step": cfg.optim.freeze_step,
            "loss": "validation loss" if val else f"training loss, {args.window}-step mean",
            "seeds": args.seeds, "steps": cfg.train.steps, "extra_set": args.set,
            "window": args.window, "target_loss": args.target_loss or None,
            "target_factor": None if args.target_loss else args.target_factor,
            "loadavg_1min_start": load0, "loadavg_1min_end": os.getloadavg()[0], "cores": os.cpu_count()}
    print(table_b(summary, info))
    doc = dump(args.json, {"part": "B", "info": info, "summary": summary, "rows": runs})
    for path in plot_curves(doc, os.path.splitext(args.json)[0] + ".png"):
        print(f"plot: {path}")
    return 1 if any(r["rc"] or not r["n_steps"] for r in runs) else 0

"""Tables, JSON and plots of benchmarks/compression.py (part B's per-spec summary, its loss curves).

matplotlib is optional (setup.cfg extra ``plot``): without it no plot is drawn and the
tables and JSON are unchanged.
"""

from __future__ import annotations

import json
import os
import platform
import time


def fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def dump(path: str, doc: dict) -> dict:
    """``doc`` with the date and machine added, written to ``path`` as JSON; returns what was written."""
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.node(), **doc}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"json: {path}")
    return doc


def _header(info: dict, summary: list[dict]) -> str:
    s0 = summary[0]
    if info["target_factor"]:
        target = f"target: {info['target_factor']} x none's last curve point of the same seed"
    else:
        target = f"target: loss <= {fmt(info['target_loss'], '.4f')}"
    sets = "".join(f"--set {x}, " for x in info["extra_set"])
    if info.get("baseline"):
        target += f" (none's runs from {info['baseline']})"
    if info.get("compress_start_step"):
        target += (f"; compressed from step {info['compress_start_step']}, AdamW's second moment frozen from "
                   f"step {info['freeze_step']}" if info.get("freeze_step") else
                   f"; compressed from step {info['compress_start_step']}")
    return (f"{info['loss']} of {info['config']} ({sets.rstrip(', ') or 'as it is'}), seeds "
            f"{', '.join(map(str, info['seeds']))}, {s0['ranks']} ranks on {s0['nodes']} node(s) via "
            f"`{info['launcher']}`; {target}; load average {info['loadavg_1min_start']:.1f} -> "
            f"{info['loadavg_1min_end']:.1f} on {info['cores']} cores")


def table_b(summary: list[dict], info: dict) -> str:
    """One row per spec, means over its seeds (docs/benchmarks.md explains the columns)."""
    lines = [_header(info, summary), "",
             "| compressor | scope | steps | sent/rank/step MB | ratio (step) | ratio (run) | enc+dec ms/step "
             "| step ms | final loss | min - max | x none | reached | steps to target | s to target | speed-up "
             "| link MB | exit |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        spread = f"{fmt(s['final_min'], '.4f')} - {fmt(s['final_max'], '.4f')}" if len(s["seeds"]) > 1 else "-"
        lines.append(f"| {s['compressor']} | {s['scope']} | {s['n_steps']} | {fmt(s['step_sent_mb'], '.3f')} | "
                     f"{fmt(s['step_ratio'], '.1f')} | {fmt(s['run_ratio'], '.1f')} | {fmt(s['codec_ms'], '.1f')} | "
                     f"{fmt(s['step_ms'], '.0f')} | {fmt(s['final_loss'], '.4f')} | {spread} | "
                     f"{fmt(s['loss_vs_none'], '.3f')} | {s['reached']}/{len(s['seeds'])} | "
                     f"{fmt(s['target_step'], '.0f')} | {fmt(s['target_s'], '.1f')} | {fmt(s['speedup'], '.2f')} | "
                     f"{fmt(s['link_mb'], '.0f')} | {s['rc']} |")
    return "\n".join(lines)


def mean_curve(runs: list[dict]) -> list[tuple]:
    """(step, mean seconds, mean loss) over the runs' curves, at the steps every run has."""
    common = set.intersection(*({p[0] for p in r["curve"]} for r in runs)) if runs else set()
    out = []
    for step in sorted(common):
        pts = [next(p for p in r["curve"] if p[0] == step) for r in runs]
        out.append((step, sum(p[1] for p in pts) / len(pts), sum(p[2] for p in pts) / len(pts)))
    return out


def plot_curves(doc: dict, path: str) -> list[str]:
    """Loss against steps and against seconds of training, one line per spec (mean over seeds), the
    target of the first seed dotted; [] without matplotlib or curves."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [r for r in doc["rows"] if r["curve"]]
    if not rows:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for spec in dict.fromkeys(r["spec"] for r in rows):
        pts = mean_curve([r for r in rows if r["spec"] == spec])
        if not pts:
            continue
        style = "-" if spec == "none" else "-o" if len(pts) < 40 else "-"
        for ax, x in zip(axes, (0, 1)):
            ax.plot([p[x] for p in pts], [p[2] for p in pts], style, ms=3, label=spec, lw=1.2)
    target = next((r["target"] for r in rows if r.get("target")), None)
    info = doc["info"]
    for ax, xlabel in zip(axes, ("step", "seconds of training (sum of step times)")):
        if target:
            ax.axhline(target, color="gray", ls=":", lw=1, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(info["loss"])
        ax.grid(alpha=0.3)
    axes[0].set_title("loss against steps", fontsize=10)
    axes[1].set_title("loss against wall-clock", fontsize=10)
    lo = min(p[2] for r in rows for p in r["curve"])
    axes[0].set_ylim(lo * 0.97, lo * 1.6)
    axes[1].set_ylim(lo * 0.97, lo * 1.6)
    axes[1].legend(fontsize=7)
    seeds = ", ".join(map(str, info["seeds"]))
    fig.suptitle(f"{info['config']}, seeds {seeds} (mean), `{info['launcher']}`, {doc['date']} on "
                 f"{doc['machine']}", fontsize=7, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

"""The plots of ``benchmarks/scaling.py`` (``python -m hpctrain bench report``), from its JSON.

``scaling.png``: speedup against ranks per mode (hpctrain solid, PyTorch DDP
dashed, the independent no-communication ceiling dotted with triangles, ideal
dotted grey) and the hpctrain / PyTorch ratio; ``split.png``: each run's step
split as fractions of the mean step. Everything is derived by
:mod:`hpctrain.bench_report`; matplotlib is optional (setup.cfg extra ``plot``).
"""

from __future__ import annotations

import os

from .bench_report import CEILING, PEERS, PHASES, comparisons, derive, machine_line

SHORT = {"hpctrain": "hp", CEILING: "ind", **{p: "pt" for p in PEERS}}
LABEL = {"hpctrain": "hpctrain", CEILING: "independent (no comm)", **{p: "PyTorch DDP" for p in PEERS}}
STYLE = {"hpctrain": "-o", CEILING: ":^", **{p: "--s" for p in PEERS}}


def plots(doc: dict, directory: str) -> list[str]:
    """scaling.png and split.png; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return []
    rows = [r for r in derive(doc) if r["samples_per_s"]]
    if not rows:
        return []
    models = list(doc["models"])
    colors = dict(zip(models, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    modes = [m for m in ("weak", "strong") if any(r["mode"] == m for r in rows)]
    comp = [c for c in comparisons(doc, rows) if c["ratio"]]
    fig, axes = plt.subplots(1, len(modes) + bool(comp), figsize=(5.2 * (len(modes) + bool(comp)), 4.2),
                             squeeze=False)
    axes = list(axes[0])
    for ax, mode in zip(axes, modes):
        for model in models:
            for trainer, style in STYLE.items():
                sel = sorted((r for r in rows if (r["mode"], r["model"], r["trainer"]) == (mode, model, trainer)),
                             key=lambda r: r["ranks"])
                if sel:
                    ax.plot([r["ranks"] for r in sel], [r["speedup"] for r in sel], style, color=colors[model],
                            label=f"{model} {LABEL[trainer]}")
        ranks = sorted({r["ranks"] for r in rows})
        ax.plot(ranks, [n / ranks[0] for n in ranks], ":", color="gray", label="ideal")
        if doc["machine"]["cores"] < ranks[-1]:
            ax.axvspan(doc["machine"]["cores"] + 0.05, ranks[-1] + 0.5, color="gray", alpha=0.12,
                       label="ranks > cores")
        ax.set_xticks(ranks)
        ax.set_title(f"{mode} scaling: samples/s over 1 rank", fontsize=10)
        ax.set_xlabel("ranks")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if comp:
        ax = axes[-1]
        labels = [f"{c['model']} {c['mode'][0]} n{c['ranks']}" for c in comp]
        ratios = [c["ratio"] for c in comp]
        bars = ax.bar(range(len(comp)), ratios, color=[colors[c["model"]] for c in comp])
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in ratios], fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(comp)))
        ax.set_xticklabels(labels, rotation=60, fontsize=7)
        if max(ratios) / min(ratios) > 10:  # tiny models: PyTorch's per-step overhead dwarfs the rest
            ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_title("hpctrain / PyTorch DDP samples/s (w = weak, s = strong)", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(machine_line(doc), fontsize=6, wrap=True)
    fig.tight_layout()
    paths = [os.path.join(directory, "scaling.png")]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    sel = sorted(rows, key=lambda r: (r["mode"], models.index(r["model"]), r["ranks"], r["trainer"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(sel) + 2), 4.2))
    bottom = [0.0] * len(sel)
    for phase in PHASES:
        frac = [r["split_ms"].get(phase, 0.0) / max(1e-12, r["step_ms"]["mean"]) for r in sel]
        ax.bar(range(len(sel)), frac, bottom=bottom, label=phase.replace("_", " "))
        bottom = [b + f for b, f in zip(bottom, frac)]
    ax.set_xticks(range(len(sel)))
    ax.set_xticklabels([f"{r['mode'][0]} {r['model']} {SHORT.get(r['trainer'], r['trainer'])} "
                        f"n{r['ranks']}" for r in sel], rotation=90, fontsize=7)
    ax.set_ylabel("fraction of the mean step")
    ax.set_title("step split (w/s = weak/strong, hp = hpctrain, pt = PyTorch DDP, ind = independent)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    paths.append(os.path.join(directory, "split.png"))
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths

"""Tables and plots of ``benchmarks/scaling.py``, rebuilt from its JSON alone.

``python -m hpctrain bench report DIR`` reads ``DIR/scaling.json`` (or joins ``DIR/*/scaling.json``,
e.g. one per task of a job array) and writes ``DIR/scaling.md`` (the benchmark's Markdown tables)
and, with matplotlib (setup.cfg extra ``plot``), ``DIR/scaling.png`` and ``DIR/split.png``
(:func:`plots`). Everything derived (speedup, efficiency, comm/compute, the hpctrain / PyTorch
ratio, loss agreement) is computed here from the raw rows, so a report is the same whether printed
by the run or rebuilt later.

The document: ``rows`` (one training run each: trainer, model, mode, ranks, global_batch,
per_rank_batch, tokens_per_row, step_ms, split_ms, comm_ms, ops_ms, losses, rc), ``models`` (name ->
kind, sizes, params, batches; older files keep the batches in ``args``), ``machine`` and ``args``.
Every field and its unit: docs/benchmarks.md, "scaling.json".
"""

from __future__ import annotations

import glob
import json
import os
import sys

PHASES = ("data", "forward", "backward", "exposed_comm", "optimizer", "checkpoint", "other")
PEERS = ("torch_ddp", "torch_gpt")  # the PyTorch DDP peers: of the MLP, of the GPT
OPS = ("gemm", "attention", "layernorm", "embedding", "loss", "elementwise", "optimizer")  # train.op_times families
CEILING = "independent"  # N 1-rank runs at once, no communication (benchmarks/peers/independent.py)


def samples_per_s(row) -> float | None:
    m = row.get("step_ms", {}).get("median")
    return row["global_batch"] / (m / 1e3) if m else None


def _series(r) -> tuple:
    """Runs that form one scaling curve: same trainer, model, mode and the batch the mode keeps fixed."""
    return r["trainer"], r["model"], r["mode"], r["per_rank_batch"] if r["mode"] == "weak" else r["global_batch"]


def _median_runs(rows: list[dict]) -> list[dict]:
    """One row per configuration: with several runs (--repeats), the one with the median samples/s
    (the lower middle for an even count); failed runs only when no run of it succeeded."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["trainer"], r["model"], r["mode"], r["ranks"], r["global_batch"]), []).append(r)
    out = []
    for runs in groups.values():
        ok = sorted((r for r in runs if not r.get("rc") and samples_per_s(r)), key=samples_per_s)
        pick = dict(ok[(len(ok) - 1) // 2]) if ok else dict(runs[0])
        pick["runs"] = len(runs)
        out.append(pick)
    return out


def derive(doc: dict) -> list[dict]:
    """Rows with speedup (samples/s over the fewest-ranks run of the same series), efficiency
    (speedup / rank ratio), comm/compute and an oversubscription flag (ranks per node > cores)."""
    rows = _median_runs([dict(r) for r in doc["rows"]])
    cores = doc["machine"]["cores"]
    for r in rows:
        r["samples_per_s"] = samples_per_s(r)
        per_row = r.get("tokens_per_row") or 1
        r["tokens_per_s"] = r["samples_per_s"] * per_row if r["samples_per_s"] and per_row > 1 else None
        r["oversubscribed"] = r["ranks"] > cores * (r.get("nodes") or 1)
        s = r.get("split_ms") or {}
        compute = sum(s.get(k, 0.0) for k in ("forward", "backward", "optimizer"))
        r["comm_compute"] = r["comm_ms"] / compute if r.get("comm_ms") is not None and compute else None
    for r in rows:
        group = [q for q in rows if _series(q) == _series(r) and q["samples_per_s"]]
        base = min(group, key=lambda q: q["ranks"]) if group else None
        if base and r["samples_per_s"]:
            r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
            r["efficiency"] = r["speedup"] / (r["ranks"] / base["ranks"])
        else:
            r["speedup"] = r["efficiency"] = None
    return rows


def comparisons(doc: dict, rows: list[dict]) -> list[dict]:
    """hpctrain against the peer for every (model, mode, ranks) run by both."""
    tol = doc.get("args", {}).get("loss_rtol", 1e-4)
    out = []
    for h in rows:
        if h["trainer"] != "hpctrain":
            continue
        p = next((q for q in rows if q["trainer"] in PEERS and
                  (q["model"], q["mode"], q["ranks"]) == (h["model"], h["mode"], h["ranks"])), None)
        if p is None:
            continue
        a, b = h.get("losses") or [], p.get("losses") or []
        k = min(len(a), len(b))
        diff = max((abs(x - y) / abs(x) for x, y in zip(a[:k], b[:k])), default=None)
        ratio = h["samples_per_s"] / p["samples_per_s"] if h["samples_per_s"] and p["samples_per_s"] else None
        out.append({"model": h["model"], "mode": h["mode"], "ranks": h["ranks"], "hpctrain": h["samples_per_s"],
                    "torch": p["samples_per_s"], "hpctrain_tokens": h["tokens_per_s"],
                    "torch_tokens": p["tokens_per_s"],
                    "peer": p["trainer"], "ratio": ratio, "steps_compared": k, "loss_rel_diff": diff,
                    "loss_rtol": tol, "agree": diff is not None and k > 0 and diff <= tol})
    return out


def ceilings(rows: list[dict]) -> list[dict]:
    """hpctrain's weak scaling against N independent 1-rank runs at once, per (model, ranks > 1) run by both:
    ``of_ceiling`` = hpctrain samples/s / independent samples/s (1.0: communication costs nothing)."""
    out = []
    for h in rows:
        if (h["trainer"], h["mode"]) != ("hpctrain", "weak") or h["ranks"] < 2 or not h["samples_per_s"]:
            continue
        c = next((q for q in rows if q["trainer"] == CEILING and q["samples_per_s"] and
                  (q["model"], q["mode"], q["ranks"], q["per_rank_batch"]) ==
                  (h["model"], "weak", h["ranks"], h["per_rank_batch"])), None)
        if c is not None:
            out.append({"model": h["model"], "ranks": h["ranks"], "oversubscribed": h["oversubscribed"],
                        "efficiency": h["efficiency"], "ceiling_efficiency": c["efficiency"],
                        "of_ceiling": h["samples_per_s"] / c["samples_per_s"]})
    return out


def _f(v, spec=".2f", none="-") -> str:
    return none if v is None else format(v, spec)


def machine_line(doc: dict) -> str:
    m = doc["machine"]
    libs = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if v)
    return (f"{doc.get('date', '')} on {m.get('host', '?')}: {m.get('cpu', '?')}, {m['cores']} cores; "
            f"{m.get('mpi', '')}; {libs}; {doc['args'].get('threads_per_rank')} thread(s) per rank; "
            f"hpctrain dist.allreduce {doc['args'].get('allreduce', 'mpi')} (unless --set); load average "
            f"{m.get('loadavg_start', 0):.1f} -> {m.get('loadavg_end', 0):.1f}")


def _model_text(m: dict) -> str:
    if m.get("kind", "mlp") == "gpt":
        return (f"GPT {m['n_layer']} x d{m['d_model']}, {m['n_head']} heads, context {m['context']}, "
                f"vocabulary {m.get('vocab', '?')}")
    return "MLP " + "-".join(map(str, [m["dim"], *m["hidden"], m.get("classes", 10)]))


def _batch(doc: dict, name: str, key: str):
    """Model ``name``'s weak per-rank (``batch``) or strong global (``strong_batch``) batch."""
    return doc["models"][name].get(key, doc["args"].get(key))


def tables(doc: dict) -> str:
    rows = derive(doc)
    out = ["# Scaling: hpctrain and PyTorch DDP", "", machine_line(doc), "",
           f"`{doc.get('command', '')}`", "",
           "Models (float32; an MLP's row is a sample, a GPT's a window of context tokens):", "",
           "| model | layers | parameters | gradient MB | per-rank batch (weak) | global batch (strong) |",
           "|---|---|---:|---:|---:|---:|"]
    for name, m in doc["models"].items():
        out.append(f"| {name} | {_model_text(m)} | {m['params']:,} | {4 * m['params'] / 1e6:.2f} | "
                   f"{_batch(doc, name, 'batch')} | {_batch(doc, name, 'strong_batch')} |")
    head = ("| model | trainer | ranks | global batch | samples/s | tokens/s | step ms | p10-p90 | data | forward "
            "| backward | exposed comm | optimizer | checkpoint | other | comm ms | comm/compute | speedup "
            "| efficiency |")
    for mode, what, key in (("strong", "global batch fixed", "strong_batch"),
                            ("weak", "per-rank batch fixed", "batch")):
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            continue
        sizes = ", ".join(f"{n} {_batch(doc, n, key)}" for n in doc["models"])
        out += ["", f"## {mode.capitalize()} scaling: {what} ({sizes})", "", head, "|---" * (head.count("|") - 1) + "|"]
        for r in sorted(sel, key=lambda r: (list(doc["models"]).index(r["model"]), r["trainer"], r["ranks"])):
            if r.get("rc"):
                out.append(f"| {r['model']} | {r['trainer']} | {r['ranks']} | {r['global_batch']} | failed "
                           f"(exit {r['rc']}) |" + " |" * 14)
                continue
            s, st = r["split_ms"], r["step_ms"]
            phases = " | ".join(_f(s.get(k)) for k in PHASES)
            star = "*" if r["oversubscribed"] else ""
            out.append(f"| {r['model']} | {r['trainer']} | {r['ranks']}{star} | {r['global_batch']} | "
                       f"{_f(r['samples_per_s'], ',.0f')} | {_f(r['tokens_per_s'], ',.0f')} | {st['median']:.2f} | "
                       f"{st['p10']:.2f}-{st['p90']:.2f} | {phases} | {_f(r.get('comm_ms'))} | "
                       f"{_f(r['comm_compute'])} | {_f(r['speedup'])}x | {_f(r['efficiency'])} |")
    comp = comparisons(doc, rows)
    if comp:
        out += ["", "## hpctrain / PyTorch DDP (same model, initial weights, data order, batch, optimizer)", "",
                "| model | mode | ranks | peer | hpctrain samples/s | PyTorch samples/s | hpctrain tokens/s | "
                "PyTorch tokens/s | ratio | loss rel. diff (first steps) | tolerance | agree |",
                "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for c in comp:
            out.append(f"| {c['model']} | {c['mode']} | {c['ranks']} | {c['peer']} | {_f(c['hpctrain'], ',.0f')} | "
                       f"{_f(c['torch'], ',.0f')} | {_f(c['hpctrain_tokens'], ',.0f')} | "
                       f"{_f(c['torch_tokens'], ',.0f')} | {_f(c['ratio'])}x | {_f(c['loss_rel_diff'], '.1e')} "
                       f"({c['steps_compared']}) | {c['loss_rtol']:.0e} | {'yes' if c['agree'] else 'NO'} |")
    out += op_tables(doc, rows)
    ceil = ceilings(rows)
    if ceil:
        out += ["", "## Weak scaling against the machine's ceiling (N independent 1-rank runs at once)", "",
                "| model | ranks | hpctrain efficiency | ceiling efficiency (no communication) | hpctrain / "
                "ceiling |", "|---|---:|---:|---:|---:|"]
        for c in ceil:
            out.append(f"| {c['model']} | {c['ranks']}{'*' if c['oversubscribed'] else ''} | "
                       f"{_f(c['efficiency'])} | {_f(c['ceiling_efficiency'])} | {_f(c['of_ceiling'])} |")
        out += ["", "ceiling = the same weak configuration as N separate 1-rank trainings started together on the "
                "same cores (benchmarks/peers/independent.py): what N ranks lose with no communication at all "
                "(shared caches and memory bus, the hypervisor, clocks); hpctrain / ceiling = what hpctrain's "
                "gradient all-reduce and per-step synchronisation cost on top."]
    skipped = doc.get("peer_skipped")
    if skipped:
        out += ["", f"PyTorch peer skipped: {skipped}"]
    runs = max((r["runs"] for r in rows), default=1)
    if runs > 1:
        out += ["", f"Each row: the run with the median samples/s of {runs} (--repeats; every run is in the JSON)."]
    if doc.get("traces"):
        out += ["", "Timelines: " + ", ".join(f"`{t}`" for t in doc["traces"])]
    out += ["", "samples/s = global batch / median step time; tokens/s = samples/s x context (a GPT); step ms "
            "median and 10th-90th percentile; phase columns are means in ms per step on rank 0 (they add up to "
            "the mean step); exposed comm = waiting for gradient buckets after backward (hpctrain; PyTorch's is "
            "inside backward); comm ms = time per step reducing buckets (communication thread, or main thread "
            "for an inlined last bucket), overlapped or not; comm/compute = comm ms / (forward + backward + "
            "optimizer); speedup = samples/s over the 1-rank run of the same trainer, model and "
            "mode; efficiency = speedup / ranks; * = more ranks than cores (oversubscribed, not a scaling "
            "result)."]
    return "\n".join(out)


def _op_columns(r) -> dict:
    """ms per step per op family of run ``r``, with its exposed communication and the ops' sum."""
    ops = r.get("ops_ms") or {}
    cols = {k: ops.get(k) for k in OPS}
    # hpctrain waits for its buckets after backward (a phase); the peer's clock sees DDP's wait
    cols["exposed comm"] = ops.get("comm_wait") if r["trainer"] in PEERS else (r.get("split_ms") or {}).get(
        "exposed_comm")
    cols["sum"] = sum(v for v in cols.values() if v is not None)
    cols["step"] = r["step_ms"]["mean"]
    return cols


def op_tables(doc: dict, rows: list[dict]) -> list[str]:
    """Per model with op times (``train.op_times``): ms per step per op family, hpctrain and its PyTorch
    peer side by side at each (mode, ranks), with their ratio (> 1: hpctrain slower)."""
    out = []
    for model in doc["models"]:
        sel = [r for r in rows if r["model"] == model and r.get("ops_ms") and not r.get("rc")
               and r["trainer"] in ("hpctrain", *PEERS)]
        if not sel:
            continue
        names = list(_op_columns(sel[0]))
        out += ["", f"## Per-op time: {model} (ms per step, rank 0, mean of the timed steps)", "",
                f"| mode | ranks | trainer | {' | '.join(names)} |", "|---|---:|---|" + "---:|" * len(names)]
        for mode in ("weak", "strong"):
            for n in sorted({r["ranks"] for r in sel if r["mode"] == mode}):
                pair = {("hpctrain" if r["trainer"] == "hpctrain" else "peer"): _op_columns(r)
                        for r in sel if (r["mode"], r["ranks"]) == (mode, n)}
                for who, label in (("hpctrain", "hpctrain"), ("peer", "PyTorch")):
                    if who in pair:
                        out.append(f"| {mode} | {n} | {label} | " + " | ".join(_f(pair[who][k]) for k in names) + " |")
                if len(pair) == 2:
                    h, p = pair["hpctrain"], pair["peer"]
                    out.append(f"| {mode} | {n} | hpctrain / PyTorch | "
                               + " | ".join(f"{h[k] / p[k]:.2f}x" if h[k] and p[k] else "-" for k in names) + " |")
    if out:
        out += ["", "Per-op time: hpctrain (train.op_times) times every kernel call by family: gemm = the Linear "
                "GEMMs and the tied LM head (bias adds are elementwise), attention = the part between c_attn and "
                "c_proj (per-head GEMMs, causal softmax), elementwise = bias add + activation (GELU) and residual "
                "adds, loss = softmax cross-entropy; PyTorch (the peer's OpClock) times each op's forward call and "
                "its backward between identity autograd nodes: gemm = nn.Linear (the bias add fused in addmm) and "
                "the tied head, attention = split into heads, scaled_dot_product_attention, merge, elementwise = "
                "GELU and residual adds. optimizer = the update; exposed comm = hpctrain's wait for gradient buckets "
                "after backward, PyTorch's DDP wait after the last gradient; sum = all of these, step = the mean "
                "step (the rest: data, Python, hooks, statistics). The ratio row is hpctrain / PyTorch: above 1, "
                "hpctrain is slower at that op."]
    return out


# ---- plots (matplotlib optional: setup.cfg extra plot) ----

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


def load(directory: str) -> dict:
    """DIR/scaling.json, or else the runs of DIR/*/scaling.json joined (e.g. one per task of a job
    array over rank counts: give every task the same --strong-batch so its rows form one series)."""
    path = os.path.join(directory, "scaling.json")
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    parts = sorted(glob.glob(os.path.join(directory, "*", "scaling.json")))
    if not parts:
        raise FileNotFoundError(f"no scaling.json in {directory!r} or its subdirectories")
    docs = []
    for part in parts:
        with open(part) as fh:
            docs.append(json.load(fh))
    doc = dict(docs[0], rows=[], models={}, traces=[], parts=[os.path.relpath(p, directory) for p in parts])
    for part, d in zip(parts, docs):
        sub = os.path.relpath(os.path.dirname(part), directory)
        doc["rows"] += [dict(r, metrics=os.path.join(sub, r["metrics"])) for r in d["rows"]]
        doc["models"].update(d["models"])
        doc["traces"] += [os.path.join(sub, t) for t in d.get("traces", [])]
    loads = [d["machine"].get("loadavg_start", 0) for d in docs] + [d["machine"].get("loadavg_end", 0) for d in docs]
    doc["machine"] = dict(docs[0]["machine"], loadavg_start=min(loads), loadavg_end=max(loads))
    doc["command"] = " ; ".join(dict.fromkeys(d.get("command", "") for d in docs))
    return doc


def report(directory: str) -> tuple[str, list[str]]:
    """Write DIR/scaling.md and the plots from DIR/scaling.json (or DIR/*/scaling.json joined);
    returns (markdown, png paths)."""
    doc = load(directory)
    text = tables(doc)
    with open(os.path.join(directory, "scaling.md"), "w") as fh:
        fh.write(text + "\n")

    return text, plots(doc, directory)


def cmd_report(args) -> int:
    """``python -m hpctrain bench report DIR``."""
    try:
        text, pngs = report(args.dir)
    except (OSError, KeyError, ValueError) as exc:
        print(f"hpctrain: error: bench report: cannot read {os.path.join(args.dir, 'scaling.json')} ({exc}); "
              f"run benchmarks/scaling.py --out {args.dir} first", file=sys.stderr)
        return 2
    print(text)
    print(f"\nwrote {os.path.join(args.dir, 'scaling.md')}" + (f", {', '.join(pngs)}" if pngs else
          "; plots skipped: matplotlib is not installed (pip install matplotlib: setup.cfg extra plot)"))
    return 0

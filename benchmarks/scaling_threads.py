"""The thread sweep of benchmarks/scaling.py (``--thread-sweep``): cores per rank against PyTorch.

    python benchmarks/scaling.py --models gpt,gpt384=gpt:6-384-6-256 --thread-sweep

Per model, three ways to use a 2-core machine (``--sweep-threads T``: T cores instead of 2), every
one run by hpctrain and by the PyTorch peer at the same global batch (the model's batch x 2, as
strong scaling), so each row does the same work:

  1 rank x 1 thread     the single-core baseline
  1 rank x T threads    one process using every core (PyTorch's usual way on a CPU)
  T ranks x 1 thread    one rank per core (MPI's usual way)

Each rank is bound to as many cores as it has threads (``--sweep-launcher``, default Open MPI's
``--map-by slot:PE={threads} --bind-to core``, with ``--report-bindings``): the same binding for
both trainers, and the launcher's own report of it is kept per run. Threads: OMP, OpenBLAS, MKL,
numba and torch (the peers read OMP_NUM_THREADS) all set to the row's count. Writes threads.json
and threads.md in ``--out``: tokens/s of both, their ratio, each side's speed-up over its own
1 x 1 run, and the bindings; then ms per step per op family on both sides (``--op-times``).
"""

from __future__ import annotations

import json
import os
import re

BINDING = re.compile(r"MCW rank (\d+) (?:bound to .*: (\S+)$|is not bound)", re.M)


def bindings(log_text: str) -> list[str]:
    """Open MPI's --report-bindings lines as "rank R: [B/.]" (one letter per core of a socket, B: bound),
    or "all cores" (Open MPI: "not bound (or bound to all available processors)"), in rank order."""
    found = {}
    for m in BINDING.finditer(log_text):
        found[int(m.group(1))] = m.group(2) or "all cores"
    return [f"rank {r}: {found[r]}" for r in sorted(found)]


def configurations(threads: int) -> list[tuple[int, int]]:
    """(ranks, threads per rank) of the sweep."""
    return [(1, 1), (1, threads), (threads, 1)]


def sweep(runner, models: dict, plans: dict, peers: dict) -> int:
    """Run the sweep (module docstring); ``peers``: model kind -> peer script name. Returns the
    number of failed runs."""
    a = runner.args
    rows = []
    for name, m in models.items():
        sets, hp_sets, init, warmup = plans[name]
        per_row = m["context"] if m["kind"] == "gpt" else 1
        batch = m["batch"] * a.sweep_threads
        for n, t in configurations(a.sweep_threads):
            runner.set_threads(t, a.sweep_launcher.replace("{threads}", str(t)))
            row = {"model": name, "ranks": n, "threads": t, "global_batch": batch}
            for trainer, trainer_sets in (("hpctrain", hp_sets), (peers[m["kind"]], sets)):
                got, skipped = runner.run(trainer, name, "strong", n, batch, trainer_sets, init, warmup, 0, per_row,
                                          tag=f"x{t}")
                side = "hpctrain" if trainer == "hpctrain" else "peer"
                if got is None:
                    row[side] = {"skipped": skipped}
                    continue
                log = os.path.join(a.out, got["metrics"].replace(".jsonl", ".log"))
                text = open(log).read() if os.path.exists(log) else ""
                median = got.get("step_ms", {}).get("median")
                row[side] = {"rc": got["rc"], "step_ms": median, "losses": got.get("losses"),
                             "ops_ms": got.get("ops_ms"), "bindings": bindings(text),
                             "tokens_per_s": batch * per_row / (median / 1e3) if median else None}
            rows.append(row)
    runner.set_threads(None, None)
    with open(os.path.join(a.out, "threads.json"), "w") as fh:
        json.dump({"benchmark": "scaling-threads", "launcher": a.sweep_launcher, "rows": rows}, fh, indent=1)
    text = table(rows) + "\n\n" + ops_table(rows)
    with open(os.path.join(a.out, "threads.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)
    return sum(1 for r in rows for side in ("hpctrain", "peer") if r.get(side, {}).get("rc"))


def table(rows: list) -> str:
    """The Markdown table: tokens/s of both sides, ratio, each side's speed-up over its 1 x 1 run."""
    out = ["| model | ranks x threads | hpctrain tokens/s | PyTorch tokens/s | hpctrain / PyTorch | "
           "hpctrain vs its 1 x 1 | PyTorch vs its 1 x 1 | bindings (hpctrain; PyTorch) |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    base = {r["model"]: r for r in rows if (r["ranks"], r["threads"]) == (1, 1)}
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731

    def tps(r, side):
        return (r.get(side) or {}).get("tokens_per_s")
    for r in rows:
        b = base.get(r["model"], {})
        ours, theirs = tps(r, "hpctrain"), tps(r, "peer")
        ratio = ours / theirs if ours and theirs else None
        up = [tps(r, s) / tps(b, s) if tps(r, s) and tps(b, s) else None for s in ("hpctrain", "peer")]
        bound = "; ".join(", ".join((r.get(s) or {}).get("bindings") or ["-"]) for s in ("hpctrain", "peer"))
        out.append(f"| {r['model']} | {r['ranks']} x {r['threads']} | {fmt(ours, ',.0f')} | {fmt(theirs, ',.0f')} | "
                   f"{fmt(ratio, '.2f')}x | {fmt(up[0], '.2f')}x | {fmt(up[1], '.2f')}x | {bound} |")
    return "\n".join(out)


def ops_table(rows: list) -> str:
    """Per op family, ms per step of each side and their ratio (train.op_times and the peer's clock)."""
    families = sorted({f for r in rows for side in ("hpctrain", "peer")
                       for f in ((r.get(side) or {}).get("ops_ms") or {})})
    out = ["| model | ranks x threads | trainer | " + " | ".join(families) + " |",
           "|---|---|---|" + "---:|" * len(families)]
    for r in rows:
        ours, theirs = ((r.get(s) or {}).get("ops_ms") or {} for s in ("hpctrain", "peer"))
        if not ours:
            continue
        lines = [("hpctrain", ours)] + ([("PyTorch", theirs)] if theirs else [])
        for name, ops in lines:
            out.append(f"| {r['model']} | {r['ranks']} x {r['threads']} | {name} | "
                       + " | ".join(f"{ops[f]:.1f}" if f in ops else "-" for f in families) + " |")
        if theirs:
            out.append(f"| {r['model']} | {r['ranks']} x {r['threads']} | hpctrain / PyTorch | "
                       + " | ".join(f"{ours[f] / theirs[f]:.2f}x" if ours.get(f) and theirs.get(f) else "-"
                                    for f in families) + " |")
    return "\n".join(out)

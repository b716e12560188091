"""The pipeline-parallel part of benchmarks/scaling.py (``--pipeline-parallel P [P ...]``).

    python benchmarks/scaling.py --models gpt --ranks 2 4 --pipeline-parallel 1 2 4
    python benchmarks/scaling.py --models gpt --ranks 2 --pipeline-parallel 1 2 --micro-batches 4 \\
        --pipeline-schedules 1f1b --models big=gpt:8-512-8-128 --steps 3 --warmup 1 \\
        --launcher "benchmarks/emulated_cluster.sh --rate 1gbit --np {n} --"      # across a 1 Gbit/s link

Per GPT model and rank count n, at the same global batch (the model's batch x n, as strong
scaling, so each row does the same work): p = 1, data parallelism over the n ranks (one
micro-batch: the yardstick), then for every p > 1 dividing n, every schedule (``--pipeline-schedules``)
and every m of ``--micro-batches`` that divides the data rank's rows, one hpctrain run with
``dist.pipeline_parallel = p`` and ``train.grad_accum_steps = m``. A row gives tokens/s and the
median step time; the bubble each stage measured (``pipeline_idle`` in the metrics: the part of its
first stage's schedule, which starts the first forward and ends the last backward, that it spent not
computing, by the host's clock, the mean over the timed steps) against (p - 1) / (m + p - 1) (the bubble is the slowest stage's idle, which sets the step's pace; a
faster stage idles its imbalance too, reported as 1 - its compute / the slowest's) and
against the idle the stages' own measured compute times predict (:func:`predicted_idle`: unequal
stages idle more than the formula's equal ones); the activation bytes each stage held (measured on its arrays) and the
largest, which 1F1B keeps at min(p - s, m) micro-batches and GPipe at m; the bytes rank 0 sent per
step, point-to-point and in the data group's gradient all-reduce (the trainer's counts: at 2 ranks on
two nodes every byte a rank sends crosses the link); and, under benchmarks/emulated_cluster.sh, the
bytes that crossed the emulated link in the whole run (the harness's count: start-up, with ``auto``'s
measurements and the initial broadcast, and the final evaluation included). Writes pipeline.json and pipeline.md in ``--out``.
On a machine with fewer cores than ranks this measures overhead and bubbles, not speed-up.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

LINK = re.compile(r"emulated cluster: link bytes nodeA->nodeB (\d+), nodeB->nodeA (\d+)")


def bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def predicted_idle(busy: list, m: int) -> list:
    """Each stage's idle fraction of a step if the stages take their measured compute times c_s per
    micro-batch (``busy`` / m) and messages take none: the step then lasts sum(c) + (m - 1) max(c)
    (the fill and drain through every stage, and the slowest stage setting the pace in between),
    and stage s idles 1 - m c_s / that. Equal stages give (p - 1) / (m + p - 1)."""
    c = [b / m for b in busy]
    span = sum(c) + (m - 1) * max(c)
    return [1 - m * x / span for x in c]


def sweep(runner, models: dict, plans: dict, ps: list, micro: list, schedules: list) -> int:
    """Run the sweep (see the module docstring) ``--repeats`` times, whole sweeps in turn (a burst of
    load hits one run of each configuration, not all of its runs); returns the number of failed runs."""
    a = runner.args
    runs: dict = {}   # configuration -> its rows, one per sweep
    for rep in range(a.repeats):
        for name, m in models.items():
            if m["kind"] != "gpt":
                continue
            _, hp_sets, init, warmup = plans[name]
            for n in sorted(a.ranks):
                batch = m["batch"] * n
                for p in sorted(set(ps)):
                    if n % p or p > m["n_layer"]:
                        continue
                    for schedule in (["-"] if p == 1 else schedules):
                        for k in ([1] if p == 1 else micro):
                            rows_per_rank = batch // (n // p)
                            if rows_per_rank % k:
                                continue
                            tag = f"p{p}" + ("" if p == 1 else f"-{schedule}-m{k}")
                            sets = hp_sets + [f"dist.pipeline_parallel={p}", f"train.grad_accum_steps={k}"]
                            if p > 1:
                                sets.append(f'dist.pipeline_schedule="{schedule}"')
                            row, _ = runner.run("hpctrain", name, "strong", n, batch, sets, init, warmup, rep,
                                                m["context"], tag=tag)
                            runs.setdefault((name, n, p, schedule, k), []).append(
                                _row(a, name, m, n, p, schedule, k, batch, warmup, row))
    rows = [median_row(r) for r in runs.values()]
    doc = {"benchmark": "scaling-pipeline", "repeats": a.repeats, "rows": rows}
    with open(os.path.join(a.out, "pipeline.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    text = table(rows)
    with open(os.path.join(a.out, "pipeline.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)
    return sum(1 for r in runs.values() for x in r if x["rc"])


def median_row(runs: list) -> dict:
    """One configuration's row from its runs (one per sweep): the run of median step time, with
    ``bubble_runs`` (every run's bubble) and ``bubble_measured`` their median; a failed run counts as
    the configuration's row."""
    failed = [r for r in runs if r["rc"] or r["step_ms"] is None]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["step_ms"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    bubbles = [r["bubble_measured"] for r in runs if r["bubble_measured"] is not None]
    row["runs"] = len(runs)
    row["bubble_runs"] = bubbles
    row["bubble_measured"] = float(np.median(bubbles)) if bubbles else None
    return row


def _row(a, name, m, n, p, schedule, k, batch, warmup, row) -> dict:
    metrics = os.path.join(a.out, row["metrics"])
    records = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    steps = [s for s in records if "step_time" in s]
    timed = steps[warmup:]
    log = open(metrics.replace(".jsonl", ".log")).read() if os.path.exists(metrics) else ""
    link = LINK.search(log)
    mean = lambda key: float(np.mean([s.get(key, 0) for s in timed])) if timed else None  # noqa: E731
    idle = [float(v) for v in np.mean([s["pipeline_idle"] for s in timed], axis=0)] if p > 1 and timed else []
    busy = [float(v) for v in np.mean([s["pipeline_busy"] for s in timed], axis=0)] if p > 1 and timed else []
    held = steps[0].get("pipeline_activation_bytes", []) if steps else []
    return {"model": name, "ranks": n, "p": p, "data_parallel": n // p, "schedule": schedule, "micro_batches": k,
            "global_batch": batch, "rc": row["rc"], "step_ms": row.get("step_ms", {}).get("median"),
            "tokens_per_s": (batch * m["context"] / (row["step_ms"]["median"] / 1e3) if row.get("step_ms") else None),
            "idle_per_stage": idle, "bubble_formula": bubble(p, k),
            "idle_predicted": predicted_idle(busy, k) if busy else [], "busy_ms_per_stage": [1e3 * b for b in busy],
            # the bubble: the slowest stage's idle (it sets the pace; the others also wait for it)
            "bubble_measured": idle[int(np.argmax(busy))] if busy else None,
            "imbalance": 1 - min(busy) / max(busy) if busy and max(busy) > 0 else None,
            "activation_bytes_per_stage": held,
            "p2p_bytes_per_step": mean("pipeline_bytes_sent"), "allreduce_bytes_per_step": mean("bytes_sent"),
            "link_bytes_run": int(link.group(1)) + int(link.group(2)) if link else None}


def _spread(values: list) -> str:
    return f" [{min(values):.3f}-{max(values):.3f}]" if len(values) > 1 else ""


def table(rows: list) -> str:
    """The Markdown table of the sweep, with the p = 1 run of the same model and ranks as yardstick."""
    out = ["| model | ranks | p | data parallel | schedule | m | tokens/s | step ms | vs p = 1 | idle per stage "
           "(measured) | idle per stage (predicted from the stages' compute) | bubble (the slowest stage's idle: median of the runs, [range]) | "
           "(p-1)/(m+p-1) | imbalance (1 - fastest / slowest stage's compute) | activations "
           "MB per stage (held) | MB sent / step by rank 0: p2p + all-reduce | MB across the link, whole run |",
           "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|"]
    base = {(r["model"], r["ranks"]): r for r in rows if r["p"] == 1}
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        b = base.get((r["model"], r["ranks"]))
        ratio = (r["step_ms"] / b["step_ms"]) if b and b["step_ms"] and r["step_ms"] else None
        idle = " / ".join(f"{v:.2f}" for v in r["idle_per_stage"]) or "-"
        predicted = " / ".join(f"{v:.2f}" for v in r["idle_predicted"]) or "-"
        held = " / ".join(f"{v / 1e6:.1f}" for v in r["activation_bytes_per_stage"]) or "-"
        sent = (r["p2p_bytes_per_step"] or 0) + (r["allreduce_bytes_per_step"] or 0)
        out.append(f"| {r['model']} | {r['ranks']} | {r['p']} | {r['data_parallel']} | {r['schedule']} | "
                   f"{r['micro_batches']} | {fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['step_ms'], '.1f')} | "
                   f"{fmt(ratio, '.2f')}x | {idle} | {predicted} | {fmt(r.get('bubble_measured'), '.3f')}{_spread(r.get('bubble_runs', []))} | "
                   f"{r['bubble_formula']:.3f} | {fmt(r.get('imbalance'), '.3f')} | {held} | "
                   f"{fmt(r['p2p_bytes_per_step'] and r['p2p_bytes_per_step'] / 1e6, '.2f')} + "
                   f"{fmt(r['allreduce_bytes_per_step'] and r['allreduce_bytes_per_step'] / 1e6, '.2f')} = "
                   f"{sent / 1e6:.2f} | {fmt(r['link_bytes_run'] and r['link_bytes_run'] / 1e6, ',.0f')} |")
    return "\n".join(out)

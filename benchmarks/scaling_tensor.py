"""The tensor-parallel part of benchmarks/scaling.py (``--tensor-parallel T [T ...]``).

    python benchmarks/scaling.py --models gpt --ranks 2 --tensor-parallel 1 2

Per GPT model and rank count n, one hpctrain run per t that divides n and the model's heads,
all at the same global batch (the model's batch x n, as strong scaling), so each row does the
same work: tokens/s, median step time, the tensor group's all-reduces per step (count, bytes
sent per rank as the trainer counts them, wall time), the same bytes from the formula, and the
parameter memory per rank (the start-up line's computed bytes). Writes tensor.json and tensor.md
in ``--out``. On a machine with fewer cores than ranks this measures overhead, not speed-up.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

PARAMS = re.compile(r"memory per rank \(computed\): parameters ([\d,.]+) MB")


def formula_bytes(m: dict, n: int, t: int, batch: int, itemsize: int = 4) -> float:
    """Bytes one rank sends per step in the tensor group's all-reduces: per block two in forward
    (attention and MLP output projections) and two in backward (their input gradients), each of
    an (N, C) array with N the data group's rows x context, by ring: 2 (t - 1) / t of it."""
    if t == 1:
        return 0.0
    rows = batch // (n // t) * m["context"]
    return 4 * m["n_layer"] * rows * m["d_model"] * itemsize * 2 * (t - 1) / t


def split_params(m: dict, t: int) -> tuple[int, int]:
    """(parameters one rank holds, of which split) for a GPT of m's shape at tensor parallel t."""
    C, L = m["d_model"], m["n_layer"]
    split = L * (C * 3 * C + 3 * C + C * C + C * 4 * C + 4 * C + 4 * C * C)
    replicated = m["vocab"] * C + m["context"] * C + L * (4 * C + 2 * C) + 2 * C
    return replicated + split // t, split // t


def sweep(runner, models: dict, plans: dict, ts: list) -> int:
    """Run the sweep (see the module docstring); returns the number of failed runs."""
    a = runner.args
    rows = []
    for name, m in models.items():
        if m["kind"] != "gpt":
            continue
        sets, hp_sets, init, warmup = plans[name]
        for n in sorted(a.ranks):
            batch = m["batch"] * n
            for t in ts:
                if n % t or m["n_head"] % t:
                    continue
                row, _ = runner.run("hpctrain", name, "strong", n, batch, hp_sets + [f"dist.tensor_parallel={t}"],
                                    init, warmup, 0, m["context"], tag=f"t{t}")
                metrics = os.path.join(a.out, row["metrics"])
                steps = [json.loads(x) for x in open(metrics)][warmup:] if os.path.exists(metrics) else []
                steps = [s for s in steps if "step_time" in s]
                log = open(metrics.replace(".jsonl", ".log")).read() if os.path.exists(metrics) else ""
                found = PARAMS.search(log)
                mean = lambda k: float(np.mean([s.get(k, 0) for s in steps])) if steps else None  # noqa: E731
                params, split = split_params(m, t)
                rows.append({"model": name, "ranks": n, "t": t, "data_parallel": n // t, "global_batch": batch,
                             "rc": row["rc"], "step_ms": row.get("step_ms", {}).get("median"),
                             "tokens_per_s": (batch * m["context"] / (row["step_ms"]["median"] / 1e3)
                                              if row.get("step_ms") else None),
                             "tensor_allreduces": mean("tensor_allreduces"),
                             "tensor_bytes_sent": mean("tensor_bytes_sent"),
                             "tensor_allreduce_ms": 1e3 * mean("tensor_allreduce_time") if steps else None,
                             "formula_bytes": formula_bytes(m, n, t, batch),
                             "param_mb": float(found.group(1).replace(",", "")) if found else None,
                             "param_mb_formula": params * 4 / 1e6, "split_params": split})
    doc = {"benchmark": "scaling-tensor", "rows": rows}
    with open(os.path.join(a.out, "tensor.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    text = table(rows)
    with open(os.path.join(a.out, "tensor.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)
    return sum(1 for r in rows if r["rc"])


def table(rows: list) -> str:
    """The Markdown table of the sweep, with the t = 1 run of the same model and ranks as yardstick."""
    out = ["| model | ranks | t | data parallel | tokens/s | step ms | vs t = 1 | tensor all-reduces / step | "
           "MB sent / step (counted) | MB / step (formula) | ms in them / step | parameters MB / rank "
           "(computed) | formula |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["model"], r["ranks"]): r for r in rows if r["t"] == 1}
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        b = base.get((r["model"], r["ranks"]))
        ratio = (r["step_ms"] / b["step_ms"]) if b and b["step_ms"] and r["step_ms"] else None
        out.append(f"| {r['model']} | {r['ranks']} | {r['t']} | {r['data_parallel']} | "
                   f"{fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['step_ms'], '.1f')} | {fmt(ratio, '.2f')}x | "
                   f"{fmt(r['tensor_allreduces'], '.0f')} | {fmt(r['tensor_bytes_sent'] and r['tensor_bytes_sent'] / 1e6, '.2f')} | "
                   f"{r['formula_bytes'] / 1e6:.2f} | {fmt(r['tensor_allreduce_ms'], '.1f')} | "
                   f"{fmt(r['param_mb'], '.2f')} | {r['param_mb_formula']:.2f} |")
    return "\n".join(out)

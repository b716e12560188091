"""Collect what scripts/gpu-check.sh left in OUTDIR into gpu-check.md and gpu-check.json.

    python scripts/gpu_report.py OUTDIR

Reads steps.tsv (name, exit status, seconds per step), env.txt, the gpu tests' JUnit XML,
kernels.json (benchmarks/kernels.py), gpu_step.json and its log's tables (benchmarks/gpu_step.py),
the training runs' metrics (runs/*.jsonl) and the GPT-vs-PyTorch DDP benchmark's scaling.md.
Exit 0 when every step passed, else 1.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

WARMUP = 10  # steps left out of a run's rate (JIT compilation, first touch)


def read(path, default=""):
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return default


def steps(out):
    rows = []
    for line in read(os.path.join(out, "steps.tsv")).splitlines():
        name, rc, secs = line.split("\t")
        if rc in ("skipped", "budget"):  # left out by GPU_CHECK_SKIP / not started: GPU_CHECK_BUDGET_S ran out
            rows.append({"name": name, "rc": None, "seconds": 0.0, "budget": rc == "budget"})
            continue
        rows.append({"name": name, "rc": int(rc), "seconds": float(secs)})
    return rows


def tests(out):
    path = os.path.join(out, "logs", "gpu-tests.xml")
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:  # pytest killed by the step's time limit mid-write
        return {"tests": 0, "failures": 0, "errors": 1, "skipped": 0, "failed": [f"unreadable JUnit XML: {exc}"]}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "failed": failed}


def run_summary(path):
    """Rate and last loss of one training run's metrics (rank 0's JSON lines)."""
    lines = [json.loads(x) for x in read(path).splitlines() if x.strip()]
    lines = [x for x in lines if "step" in x]
    if not lines:
        return None
    timed = lines[WARMUP:] or lines
    secs = sum(x.get("step_time", 0.0) for x in timed)
    out = {"steps": lines[-1]["step"], "loss": lines[-1].get("loss"), "mfu": lines[-1].get("mfu")}
    for unit in ("tokens", "samples"):  # each line's rate x its step time = the step's rows
        n = sum(x.get(f"{unit}_per_s", 0.0) * x.get("step_time", 0.0) for x in timed)
        if n and secs:
            out[f"{unit}_per_s"] = n / secs
    return out


def main(out):
    doc = {"env": read(os.path.join(out, "env.txt")).strip().splitlines(), "steps": steps(out),
           "tests": tests(out), "kernels": json.loads(read(os.path.join(out, "kernels.json"), "null")),
           "gpu_step": json.loads(read(os.path.join(out, "gpu_step.json"), "null")), "runs": {}}
    runs_dir = os.path.join(out, "runs")
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        if name.endswith(".jsonl"):
            doc["runs"][name[:-6]] = run_summary(os.path.join(runs_dir, name))
    run = [s for s in doc["steps"] if s["rc"] is not None]
    skipped = [s["name"] for s in doc["steps"] if s["rc"] is None]
    # a step the budget left out is a check not done: the whole check did not pass
    ok = bool(run) and all(s["rc"] == 0 for s in run) and not any(s.get("budget") for s in doc["steps"])
    doc["skipped"] = skipped
    doc["passed"] = ok
    with open(os.path.join(out, "gpu-check.json"), "w") as fh:
        json.dump(doc, fh, indent=1)

    md = ["# hpctrain GPU check", "", "```", *doc["env"], "```", "",
          f"**{'PASSED' if ok else 'FAILED'}**" + (f" (skipped: {', '.join(skipped)})" if skipped else ""), "",
          "| step | exit | seconds |", "|---|---|---|"]
    md += [f"| {s['name']} | {('out of budget' if s.get('budget') else 'skipped') if s['rc'] is None else s['rc']} "
           f"| {s['seconds']:.1f} |"
           for s in doc["steps"]]
    t = doc["tests"]
    if t:
        md += ["", f"GPU tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, "
                   f"{t['skipped']} skipped"] + [f"- FAILED {f}" for f in t["failed"]]
    kernels_log = read(os.path.join(out, "logs", "kernels.log"))
    table = [x for x in kernels_log.splitlines() if x.startswith("|")]
    if table:
        md += ["", "## Kernels (benchmarks/kernels.py)", "", *table]
    step_log = read(os.path.join(out, "logs", "gpu-step.log")).splitlines()
    report = [x for x in step_log if x.startswith(("|", "GPT training step", "Per-op split", "Host cost"))]
    if report:
        md += ["", "## A GPT step against PyTorch eager (benchmarks/gpu_step.py)", ""]
        for line in report:  # a blank line before each caption, as the benchmark prints them
            md += ([""] if not line.startswith("|") and md[-1] != "" else []) + [line] + \
                  ([""] if not line.startswith("|") else [])
    if doc["runs"]:
        md += ["", "## Training on cuda", "", "| run | steps | final loss | rate (after warm-up) |", "|---|---|---|---|"]
        for name, r in doc["runs"].items():
            if r is None:
                md.append(f"| {name} | - | - | no metrics |")
                continue
            rate = (f"{r['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in r else
                    f"{r.get('samples_per_s', 0):,.0f} samples/s")
            mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else ""
            md.append(f"| {name} | {r['steps']} | {r['loss']:.4f} | {rate}{mfu} |")
    scaling = read(os.path.join(out, "scaling", "scaling.md"))
    if scaling:
        md += ["", "## GPT: hpctrain against PyTorch DDP on the same GPU (benchmarks/scaling.py)", "", scaling]
    for s in run:
        if s["rc"] != 0:
            tail = read(os.path.join(out, "logs", s["name"] + ".log")).splitlines()[-40:]
            md += ["", f"## {s['name']}: exit {s['rc']} (last lines of logs/{s['name']}.log)", "", "```", *tail,
                   "```"]
    with open(os.path.join(out, "gpu-check.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/gpu_report.py OUTDIR")
    sys.exit(main(sys.argv[1]))

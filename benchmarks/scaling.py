"""Strong and weak scaling over rank counts, per model size, with PyTorch DDP in the same run.

    python benchmarks/scaling.py                                    # 1 2 4 ranks, small mid large, ~10 min here
    python benchmarks/scaling.py --ranks 1 2 --models mid --modes weak
    python benchmarks/scaling.py --models gpt --ranks 1 2 4         # the GPT (examples/gpt.toml's), ~5 min here
    python benchmarks/scaling.py --launcher "srun --mpi=pmix -n {n}" --ranks 1 2 4 8 16   # in an allocation
    python -m hpctrain bench report runs/bench/scaling                   # table + plots again from the JSON
    python benchmarks/scaling.py --models gpt --ranks 2 --tensor-parallel 1 2    # tensor parallelism's overhead
    python benchmarks/scaling.py --models gpt --ranks 2 4 --pipeline-parallel 1 2 4   # bubbles, memory, bytes
    python benchmarks/scaling.py --models gpt,gpt384=gpt:6-384-6-256 --thread-sweep   # cores per rank vs PyTorch

A plain-python driver (never under mpirun itself): per configuration it runs
``<launcher> python -m hpctrain train --set ...`` (``{n}`` in ``--launcher`` is
the rank count) and reads the per-step metrics JSON lines of rank 0, leaving
out ``--warmup`` steps (JIT compilation, first touch, the first read-ahead).

* weak: per-rank batch ``--batch`` fixed (default per kind: 256 rows for an
  MLP, 16 windows for a GPT), global batch = batch x ranks; strong: global batch
  ``--strong-batch`` fixed (default batch x the largest rank count:
  ``--largest-ranks``, else the largest of ``--ranks``).
* models (benchmarks/scaling_models.py): MLP presets ``small`` (latency-bound),
  ``mid``, ``large`` (4096-wide, compute-bound) or ``name=DIM-H1-H2...`` (e.g.
  ``tiny=8-16``); the GPT preset ``gpt`` (examples/gpt.toml's model and optimizer
  on ``--text``) or ``name=gpt:LAYERS-D-HEADS-CONTEXT``. A GPT's rows also give
  tokens/s (samples/s x context).
* per-op split (``--op-times``, default the GPT models): ``train.op_times=true``
  in both trainers' runs; hpctrain times each kernel call by family, the GPT
  peer each op's forward call and, between identity autograd nodes, its
  backward (overhead within this machine's noise, measured at < 2 %); the report
  adds a table per model, ms per step per family, side by side.
* every rank gets ``--threads-per-rank`` BLAS/numba/torch threads in every
  configuration (default cores // that largest count, at least 1), so a rank has the same
  resources at 1 rank as at N and the runs measure scaling, not thread count.
* peer (``--peer-models``, default mid,gpt): ``benchmarks/peers/torch_ddp.py``
  (an MLP) or ``torch_gpt.py`` (a GPT) right after the hpctrain run of the same
  configuration, from the same step-0 checkpoint
  (``benchmarks/peers/init_checkpoint.py``; hpctrain resumes from it), same
  data order, batch and optimizer; the first ``--compare-steps``
  global losses of the two must agree within ``--loss-rtol`` (relative).
* ceiling (``--ceiling-models``, default all): in weak mode, N independent
  1-rank copies of the hpctrain run at once under the same launcher
  (``benchmarks/peers/independent.py``, row ``independent``): what the machine
  allows without communication, so the report can say how much of the
  weak-scaling loss is the machine's and how much is hpctrain's.
* timeline (``--trace-config MODEL:N``, default mid:2): one more short hpctrain
  run with ``--trace``, merged (``python -m hpctrain trace merge``), and the
  peer's ``torch.profiler`` trace of the same configuration.
* ``--repeats R``: R whole sweeps one after another; each configuration
  reports its run with the median samples/s (all runs stay in the JSON).

Output in ``--out`` (default runs/bench/scaling): scaling.json (rows, machine,
arguments), scaling.md and the PNG plots (``hpctrain.observe.bench_report``), metrics
per run in ``runs/``. Exit 0; 1 if a run failed or the losses disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from importlib import metadata

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hpctrain.observe import bench_report  # noqa: E402 - no MPI, no numpy at import
from scaling_models import BATCH, PEER, STEPS, describe, parse_models, prepare  # noqa: E402 - beside this file

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
SINGLETON_VARS = ("PMIX_", "ORTE_", "OMPI_APP_CTX_", "OMPI_COMM_WORLD_", "OMPI_MCA_ess", "OMPI_MCA_orte_",
                  "OMPI_MCA_pmix")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--models", default="small,mid,large",
                   help="presets (small, mid, large, gpt), name=DIM-H1-H2... or name=gpt:L-D-H-T, comma-separated")
    p.add_argument("--modes", default="strong,weak")
    p.add_argument("--batch", type=int, default=0,
                   help="per-rank batch of weak scaling (0: per kind, 256 rows for an MLP, 16 windows for a GPT)")
    p.add_argument("--strong-batch", type=int, default=0,
                   help="global batch of strong scaling (0: the model's batch x --largest-ranks)")
    p.add_argument("--largest-ranks", type=int, default=0,
                   help="largest rank count of the study (0: of --ranks); set it when each job-array task "
                        "runs one count, so every task's strong scaling keeps the same global batch and "
                        "the default threads per rank are the same")
    p.add_argument("--steps", type=int, default=0,
                   help="timed steps (0: per model: small 200, mid 60, large 6, gpt 40; 20 otherwise)")
    p.add_argument("--warmup", type=int, default=-1,
                   help="steps left out first (-1: small 20, mid 10, large 2, gpt 5; 3 otherwise)")
    p.add_argument("--repeats", type=int, default=1, help="sweeps; a configuration reports its median run (1)")
    p.add_argument("--samples", type=int, default=16384, help="synthetic samples per MLP dataset (16384)")
    p.add_argument("--text", default=os.path.join(REPO, "data", "text.h5"),
                   help="token file of the GPT models (data/text.h5; made by python -m hpctrain data text if missing)")
    p.add_argument("--threads-per-rank", type=int, default=0, help="0: cores // the largest rank count, at least 1")
    p.add_argument("--launcher", default="mpirun -n {n} --oversubscribe", help="command prefix; {n} = ranks")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="train.device (cpu)")
    p.add_argument("--allreduce", default="auto",
                   help="hpctrain's dist.allreduce (auto: measured per bucket size; shm zero-copy on one machine)")
    p.add_argument("--set", action="append", default=[], help="extra --set for every run (both trainers)")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint.every_steps in the hpctrain runs (0 off)")
    p.add_argument("--peer-models", default="mid,gpt", help="models the PyTorch peer also runs ('' none)")
    p.add_argument("--peer-modes", default="weak", help="modes the PyTorch peer also runs")
    p.add_argument("--ceiling-models", default="all",
                   help="models whose weak runs also run N independent 1-rank copies at once, the "
                        "machine's ceiling without communication (benchmarks/peers/independent.py; "
                        "all (default), or '' none)")
    p.add_argument("--op-times", default="gpt", choices=["gpt", "all", "none"],
                   help="models whose runs time ops (train.op_times): the GPT ones (default), all or none")
    p.add_argument("--compare-steps", type=int, default=10, help="first steps whose losses must agree (10)")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="relative loss tolerance (float32: 1e-4)")
    p.add_argument("--trace-config", default="mid:2", help="MODEL:N traced once more ('' none)")
    p.add_argument("--tensor-parallel", type=int, nargs="*", default=[],
                   help="instead of the sweep: the GPT models at each --ranks with each dist.tensor_parallel t "
                        "given (same global batch; benchmarks/scaling_tensor.py), into tensor.json / tensor.md")
    p.add_argument("--pipeline-parallel", type=int, nargs="*", default=[],
                   help="pipeline sizes p to compare at each rank count, p = 1 (data parallel) the yardstick "
                        "(benchmarks/scaling_pipeline.py)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="train.grad_accum_steps of the --pipeline-parallel runs (1 2 4 8 16)")
    p.add_argument("--pipeline-schedules", nargs="+", default=["1f1b", "gpipe"], choices=["1f1b", "gpipe"],
                   help="schedules of the --pipeline-parallel runs (both)")
    p.add_argument("--thread-sweep", action="store_true",
                   help="instead of the sweep: each model at 1 rank x 1 thread, 1 x T and T x 1, hpctrain and the "
                        "peer, each rank bound to its threads' cores (benchmarks/scaling_threads.py), into "
                        "threads.json / threads.md")
    p.add_argument("--sweep-threads", type=int, default=2, help="T of --thread-sweep (2)")
    p.add_argument("--sweep-launcher", default="mpirun -n {n} --map-by slot:PE={threads} --bind-to core "
                                                "--report-bindings",
                   help="launcher of --thread-sweep; {n} = ranks, {threads} = threads per rank")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench", "scaling"))
    return p.parse_args(argv)


class Runner:
    """Launches runs with a fixed environment and records their rows."""

    def __init__(self, args):
        self.args, self.rows, self.failed = args, [], []
        # a calling MPI singleton (e.g. a test process) leaves its job identity in the environment,
        # and an mpirun started with it fails at once: drop it, as emulated_cluster.sh does
        env = {k: v for k, v in os.environ.items() if not k.startswith(SINGLETON_VARS)}
        self.env = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        PYTHONUNBUFFERED="1", HPCTRAIN_PROGRESS="lines")
        self.set_threads(None, None)

    def set_threads(self, threads, launcher) -> None:
        """From now on every rank gets ``threads`` threads (None: back to the default) and runs under
        ``launcher`` (None: --launcher)."""
        if threads is None:
            cores = len(os.sched_getaffinity(0))
            threads = self.args.threads_per_rank or max(1, cores // (self.args.largest_ranks or max(self.args.ranks)))
        self.threads, self.launcher = threads, launcher or self.args.launcher
        self.env.update({v: str(threads) for v in THREAD_VARS})

    def launch(self, n, argv, log):
        cmd = shlex.split(self.launcher.format(n=n)) + [sys.executable, *argv]
        t0 = time.time()
        os.makedirs(os.path.dirname(log), exist_ok=True)
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True,
                                  timeout=self.args.timeout)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, text = 124, f"timed out after {exc.timeout} s"
        with open(log, "w") as fh:
            fh.write(f"$ {shlex.join(cmd)}\n{text}")
        return rc, text, time.time() - t0

    def run(self, trainer, model, mode, n, batch, sets, init, warmup, rep=0, per_row=1, tag=""):
        a = self.args
        tag = f"{trainer}-{model}-{mode}-n{n}" + (f"-r{rep}" if a.repeats > 1 else "") + (f"-{tag}" if tag else "")
        metrics = os.path.join(a.out, "runs", tag + ".jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        sets = sets + [f"train.global_batch={batch}", f'train.metrics="{metrics}"']
        argv = (["-m", "hpctrain", "train"] if trainer == "hpctrain" else
                [os.path.join(REPO, "benchmarks", "peers", f"{trainer}.py")])
        argv += [x for s in sets for x in ("--set", s)] + ["--resume", init]
        print(f"  {tag} (global batch {batch}) ...", file=sys.stderr, flush=True)
        rc, text, wall = self.launch(n, argv, metrics.replace(".jsonl", ".log"))
        steps = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
        nodes = re.search(r"(\d+) rank\(s\) on (\d+) node", text)
        row = {"trainer": trainer, "model": model, "mode": mode, "ranks": n, "global_batch": batch, "repeat": rep,
               "nodes": int(nodes.group(2)) if nodes else None, "tokens_per_row": per_row,
               "per_rank_batch": batch // n, "rc": rc, "wall_s": wall, "metrics": os.path.relpath(metrics, a.out),
               "threads_per_rank": self.threads, **summarise(steps, warmup, a.compare_steps)}
        if rc == 77 and trainer in bench_report.PEERS:
            return None, text.strip().splitlines()[-1] if text.strip() else "skipped"
        if rc or not steps:
            self.failed.append(tag)
            print(f"  {tag}: exit {rc}\n{text[-2000:]}", file=sys.stderr)
        self.rows.append(row)
        return row, ""


def summarise(steps, warmup, compare) -> dict:
    """Medians, percentiles and mean phase and op times (ms) over the steps after ``warmup``."""
    import numpy as np

    steps = [s for s in steps if "step_time" in s]  # step lines only (evaluations share their step's line)
    timed = steps[warmup:]
    if not timed:
        return {"steps_timed": 0, "losses": [s["loss"] for s in steps[:compare]]}
    st = 1e3 * np.array([s["step_time"] for s in timed])
    mean = lambda key: 1e3 * float(np.mean([s.get(key, 0.0) for s in timed]))  # noqa: E731
    split = {"data": mean("t_data"), "forward": mean("t_forward"), "backward": mean("t_backward"),
             "exposed_comm": mean("t_allreduce"), "optimizer": mean("t_optimizer"),
             "checkpoint": mean("t_checkpoint")}
    split["other"] = float(st.mean()) - sum(split.values())
    has_comm = "comm_time" in timed[0]
    ops = sorted({k for s in timed for k in s if k.startswith("t_op_")})
    return {"steps_timed": len(timed), "warmup": warmup,
            **({"ops_ms": {k[len("t_op_"):]: mean(k) for k in ops}} if ops else {}),
            "step_ms": {"median": float(np.median(st)), "p10": float(np.percentile(st, 10)),
                        "p90": float(np.percentile(st, 90)), "mean": float(st.mean())},
            "split_ms": split, "comm_ms": mean("comm_time") if has_comm else None,
            "losses": [s["loss"] for s in steps[:compare]]}


def machine(runner) -> dict:
    try:
        mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()
    except OSError:  # no mpirun on the path (srun-only sites)
        mpi = []
    versions = {}
    for pkg in ("numpy", "numba", "mpi4py", "h5py", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"host": platform.node(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "mpi": mpi[0] if mpi else "?", "python": platform.python_version(),
            "versions": {"python": platform.python_version(), **versions}, "loadavg_start": os.getloadavg()[0]}


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        models = parse_models(a.models)
        modes = [m for m in a.modes.split(",") if m]
        if set(modes) - {"weak", "strong"} or not a.ranks or min(a.ranks) < 1 or a.repeats < 1:
            raise ValueError("--modes takes weak,strong; --ranks positive counts; --repeats >= 1")
    except ValueError as exc:
        print(f"scaling.py: error: {exc}", file=sys.stderr)
        return 2
    a.out = os.path.abspath(a.out)
    for m in models.values():
        m["batch"] = a.batch or BATCH[m["kind"]]
        m["strong_batch"] = a.strong_batch or m["batch"] * (a.largest_ranks or max(a.ranks))
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    runner = Runner(a)
    info = machine(runner)
    peer_models = {m for m in a.peer_models.split(",") if m}
    peer_modes = {m for m in a.peer_modes.split(",") if m}
    ceiling_models = set(models) if a.ceiling_models == "all" else {m for m in a.ceiling_models.split(",") if m}
    peer_skipped, traces = "", []
    plans = {}
    for name, m in models.items():
        steps, warmup = STEPS.get(name, (20, 3))
        steps, warmup = a.steps or steps, warmup if a.warmup < 0 else a.warmup
        print(f"{name}: {describe(m)}, {steps} timed + {warmup} warm-up steps", file=sys.stderr, flush=True)
        sets, init = prepare(runner, name, m, os.path.join(a.out, "data"))
        op_times = a.op_times == "all" or a.op_times == m["kind"]
        sets = sets + [f"train.steps={steps + warmup}"] + (["train.op_times=true"] if op_times else [])
        # before the user's --set, so a --set dist.allreduce=... there still wins
        hp_sets = ([f'dist.allreduce="{a.allreduce}"'] + sets
                   + ([f"checkpoint.every_steps={a.ckpt_every}"] if a.ckpt_every else []))
        plans[name] = sets, hp_sets, init, warmup
    if a.tensor_parallel:
        from scaling_tensor import sweep

        return 1 if sweep(runner, models, plans, a.tensor_parallel) else 0
    if a.pipeline_parallel:
        from scaling_pipeline import sweep

        return 1 if sweep(runner, models, plans, a.pipeline_parallel, a.micro_batches, a.pipeline_schedules) else 0
    if a.thread_sweep:
        from scaling_threads import sweep

        return 1 if sweep(runner, models, plans, PEER) else 0
    for rep in range(a.repeats):  # whole sweeps in turn: a burst of load hits one run of each, not all
        for name, (sets, hp_sets, init, warmup) in plans.items():
            m = models[name]
            per_row = m["context"] if m["kind"] == "gpt" else 1
            for mode in modes:
                for n in sorted(a.ranks):
                    batch = m["batch"] * n if mode == "weak" else m["strong_batch"]
                    if batch % n:
                        print(f"  skip {name} {mode} n{n}: {n} does not divide the global batch {batch}",
                              file=sys.stderr)
                        continue
                    run = (name, mode, n, batch)
                    runner.run("hpctrain", *run, hp_sets, init, warmup, rep, per_row)
                    if mode == "weak" and name in ceiling_models:
                        runner.run(bench_report.CEILING, *run, hp_sets, init, warmup, rep, per_row)
                    if name in peer_models and mode in peer_modes and not peer_skipped:
                        _, peer_skipped = runner.run(PEER[m["kind"]], *run, sets, init, warmup, rep, per_row)
    model_n = a.trace_config.split(":") if a.trace_config else []
    if len(model_n) == 2 and model_n[0] in plans and int(model_n[1]) in a.ranks:
        sets, hp_sets, init, _ = plans[model_n[0]]
        traces = trace(runner, model_n[0], models[model_n[0]], int(model_n[1]), hp_sets, sets, init,
                       peer_skipped or model_n[0] not in peer_models)
    info["loadavg_end"] = os.getloadavg()[0]
    doc = {"benchmark": "scaling", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": info,
           "command": shlex.join(["python", "benchmarks/scaling.py", *(sys.argv[1:] if argv is None else argv)]),
           "args": {**vars(a), "threads_per_rank": runner.threads},
           "models": models,
           "rows": runner.rows, "peer_skipped": peer_skipped, "traces": traces}
    path = os.path.join(a.out, "scaling.json")
    with open(path + ".part", "w") as fh:  # whole or not at all: job-array tasks join each other's
        json.dump(doc, fh, indent=1)
    os.replace(path + ".part", path)
    text, pngs = bench_report.report(a.out)
    print(text)
    print(f"\njson: {os.path.join(a.out, 'scaling.json')}; table: {os.path.join(a.out, 'scaling.md')}; plots: "
          + (", ".join(pngs) if pngs else "skipped (no matplotlib: pip install matplotlib, setup.cfg extra plot)"))
    disagree = [c for c in bench_report.comparisons(doc, bench_report.derive(doc)) if not c["agree"]]
    for c in disagree:
        print(f"scaling.py: FAIL: losses of hpctrain and PyTorch differ by {c['loss_rel_diff']} (> {a.loss_rtol}) "
              f"for {c['model']} {c['mode']} n{c['ranks']}", file=sys.stderr)
    if runner.failed:
        print(f"scaling.py: FAIL: runs failed: {', '.join(runner.failed)} (logs in {a.out}/runs)", file=sys.stderr)
    return 1 if runner.failed or disagree else 0


def trace(runner, name, m, n, hp_sets, sets, init, no_peer) -> list[str]:
    """A short traced run of hpctrain (merged) and of the peer at ``n`` ranks; paths relative to --out."""
    a, out = runner.args, []
    common = [f"train.global_batch={m['batch'] * n}", "train.steps=20"]  # the weak configuration
    steps = [s for s in hp_sets if not s.startswith("train.steps=")] + common
    tdir = os.path.join(a.out, "trace", f"hpctrain-{name}-n{n}")
    argv = ["-m", "hpctrain", "train", *[x for s in steps for x in ("--set", s)], "--resume", init, "--trace", tdir]
    rc, text, _ = runner.launch(n, argv, tdir + ".log")
    if rc == 0:
        merged = tdir + ".json"
        subprocess.run([sys.executable, "-m", "hpctrain", "trace", "merge", tdir, "-o", merged], cwd=REPO,
                       env=runner.env, capture_output=True)
        out.append(os.path.relpath(merged, a.out))
    else:
        runner.failed.append(f"trace {name} n{n}")
    if not no_peer:
        pdir = os.path.join(a.out, "trace", f"{PEER[m['kind']]}-{name}-n{n}")
        argv = [os.path.join(REPO, "benchmarks", "peers", f"{PEER[m['kind']]}.py"),
                *[x for s in [s for s in sets if not s.startswith("train.steps=")] + common
                  for x in ("--set", s)], "--resume", init, "--trace", pdir]
        if runner.launch(n, argv, pdir + ".log")[0] == 0:
            out.append(os.path.relpath(pdir, a.out))
    return out


if __name__ == "__main__":
    sys.exit(main())

"""What a failure costs under ``python -m hpctrain launch``, phase by phase, for three failures.

    python benchmarks/recovery.py                          # the example MLP and GPT, cases rank and stop
    python benchmarks/recovery.py --cases rank stop node --models gpt --json runs/bench/recovery.json

Cases (each once per model, on 2 ranks unless --ranks says otherwise):

  rank   SIGKILL of rank 1 under ``launch -n`` (mpirun): mpirun sees the rank die and ends the
         job; the launcher restarts it.
  stop   SIGSTOP of rank 1 under ``launch -n``: nothing ends the job (dist.comm_timeout is 300 s);
         the launcher hears the rank's heartbeats stop (HPCTRAIN_DETECT_S, default 5 s), ends
         the job itself and restarts it.
  node   a whole node crashes on the local SLURM cluster (scripts/slurm-cluster.sh: two nodes
         on this machine, SLURM's default timeouts; needs root and SLURM, as the tests do):
         requeue.sbatch on 2 nodes x ranks/2, and once the checkpoint exists node n2's slurmd,
         slurmstepd and ranks are killed at once (``lose-node``); the launcher hears n2 fall
         silent, ends the step, leaves n2 out and restarts on n1.

The failure comes once the checkpoint of step --kill-at exists. From the launcher's own lines,
timed as they arrive:

  detection      rank: from the kill to the failed job's end (mpirun notices, ends the
                 others); stop, node: from the last heartbeat to the launcher's verdict
  tear-down      stop, node: the launcher ending the job (rank: within detection)
  node probes    node: one-task sruns on the nodes not declared lost
  start-up       the restarted run: launcher, Python, imports, MPI_Init
  load + set-up  the checkpoint load and the trainer's set-up
  first step     the first new step (compilation and caches warm up here)
  total          the failure to the first new step (the launcher's own clock; the target is
                 < 30 s), and the same by this benchmark's clock from its kill, stop or crash
  redone         steps between the checkpoint and the failure, computed again

Then the job is stopped (SIGTERM to the launcher, or scancel). Data are made in a temporary
folder unless --mlp-data / --text name files. Prints a table, writes JSON. Rank 1 is found by
Open MPI's OMPI_COMM_WORLD_RANK (mpirun from Open MPI).
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 30.0
RECOVERED = re.compile(r"recovered: first new step ([\d.]+) s after (?:the failure|the failed job ended) \(([^)]*)\); "
                       r"resumed at step (\d+), (\d+) step\(s\) redone")
PHASES = {"detection": "detect_s", "tear-down": "teardown_s", "node probes": "probes_s", "start-up": "startup_s",
          "checkpoint load and set-up": "load_s", "first step": "first_step_s"}


def parse_recovered(line: str) -> dict | None:
    """The launcher's recovery line as {total_s, <phase>_s..., resumed_at, redone}, or None."""
    m = RECOVERED.search(line)
    if not m:
        return None
    row = {"total_s": float(m.group(1)), "resumed_at": int(m.group(3)), "redone": int(m.group(4))}
    for part in m.group(2).split(", "):  # "start-up 2.3 s"
        name, _, value = part.rpartition(" ")[0].rpartition(" ")
        if name in PHASES:
            row[PHASES[name]] = float(value)
    return row


def _hpctrain(*args):
    return [sys.executable, "-m", "hpctrain", *args]


def _train_args(model, data, ckpt, args):
    common = ["--set", f"checkpoint.dir={ckpt}", "--set", f"checkpoint.every_steps={args.every}",
              "--set", "checkpoint.every_minutes=0", "--set", "checkpoint.keep_last=0", "--set", "train.metrics=",
              "--set", "train.steps=1000000", "--set", "train.log_every=1000000", "--set", "train.eval_every=0"]
    if model == "mlp":
        return ["train", "--config", os.path.join(REPO, "examples", "mlp.toml"), "--set", f"data.train={data}",
                "--set", "data.eval=", "--set", "train.target_accuracy=0", *common]
    return ["train", "--config", os.path.join(REPO, "examples", "gpt.toml"), "--set", f"data.train={data}",
            "--set", "train.target_bpb_vs_bigram=0", "--set", "train.target_val_bpb=0", *common]


def _rank_pid(marker, rank):
    """The pid of MPI rank ``rank`` of the job holding ``marker`` (Open MPI's OMPI_COMM_WORLD_RANK)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().split(b"\0")
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in b" ".join(cmd) and b"hpctrain" in cmd and b"launch" not in cmd \
                and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(entry)
    return None


def measure(case, model, data, args, tmp):
    """One row: launch under mpirun (cases rank, stop) and fail it once the checkpoint exists."""
    ckpt = os.path.join(tmp, f"ck-{case}-{model}")
    cmd = _hpctrain("launch", "-n", str(args.ranks), *args.mpirun_args.split(), "--",
                    *_train_args(model, data, ckpt, args))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.time(), line.rstrip())) for line in proc.stdout],
                              daemon=True)
    reader.start()
    target = os.path.join(ckpt, f"ckpt-{args.kill_at:08d}.h5")
    end = time.time() + args.timeout
    while not os.path.exists(target) and time.time() < end and proc.poll() is None:
        time.sleep(0.05)
    pid = _rank_pid(ckpt, 1)
    if pid is None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=5)  # the job ended by itself (a bad argument, mpirun refusing root): its output
        raise SystemExit(f"recovery.py: {case} {model}: no checkpoint of step {args.kill_at} or no rank 1 "
                         f"(output:\n" + "\n".join(line for _, line in lines[-30:]) + ")")
    t_fail = time.time()
    os.kill(pid, signal.SIGKILL if case == "rank" else signal.SIGSTOP)
    row = _await_recovery(lambda: lines, t_fail, end, proc.poll)
    proc.send_signal(signal.SIGTERM)  # the launcher passes SIGUSR1 on: save, exit 75
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=5)
    if case == "stop":
        try:
            os.kill(pid, signal.SIGKILL)  # torn down by the launcher already, normally
        except OSError:
            pass
    if row is None:
        raise SystemExit(f"recovery.py: {case} {model}: no recovery line (output:\n"
                         + "\n".join(line for _, line in lines[-40:]) + ")")
    return dict(row, case=case, model=model, ranks=args.ranks, killed_after_step=args.kill_at,
                lines=[line for _, line in lines if line.startswith("hpctrain launch: ")])


def _await_recovery(lines, t_fail, end, ended):
    """The recovery row once the launcher printed its first failure and recovery lines; None at
    ``end`` or when the launcher ended first. ``lines()``: [(arrival time, line)]."""
    while time.time() < end and ended() is None:
        seen = lines()
        failed = [t for t, line in seen if "hpctrain launch: failure 1:" in line]
        got = [(t, parse_recovered(line)) for t, line in seen if "hpctrain launch: recovered:" in line]
        if failed and got:
            t_got, row = got[0]
            if "detect_s" not in row:  # the job ended by itself: detection and tear-down by our clock
                row["detect_s"] = failed[0] - t_fail
                row["total_s"] += row["detect_s"]
            row["total_by_clock_s"] = t_got - t_fail
            return row
        time.sleep(0.05)
    return None


def node_crash(model, data, args, tmp):
    """The node case: a local two-node SLURM cluster, requeue.sbatch on both nodes, n2 crashed."""
    script = os.path.join(REPO, "scripts", "slurm-cluster.sh")
    if shutil.which("slurmctld") is None:
        raise SystemExit("recovery.py: the node case needs SLURM (bash scripts/slurm-cluster.sh install, as root)")
    root = tempfile.mkdtemp(prefix="hpctrain-slurm-", dir="/tmp")  # short: munge's socket path must fit
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_", "HPCTRAIN_"))}
    env.update(SLURM_CONF=os.path.join(root, "etc", "slurm.conf"), PATH=env.get("PATH", "") + ":/usr/sbin:/sbin",
               PYTHONUNBUFFERED="1", HPCTRAIN_PYTHON=sys.executable, HPCTRAIN_HOME=REPO,
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl="self,tcp", OMPI_MCA_btl_tcp_if_include="lo")  # the nodes share this host
    out, ckpt = os.path.join(tmp, f"node-{model}.out"), os.path.join(tmp, f"ck-node-{model}")
    started = subprocess.run(["bash", script, "start", root, "2"], capture_output=True, text=True, timeout=120)
    if started.returncode:
        raise SystemExit(f"recovery.py: the SLURM cluster did not start:\n{started.stdout}{started.stderr}")
    job = None
    try:
        job = subprocess.run(["sbatch", "--parsable", "-N", "2", f"--ntasks-per-node={max(1, args.ranks // 2)}",
                              f"--output={out}", os.path.join(REPO, "jobs", "requeue.sbatch"),
                              *_train_args(model, data, ckpt, args)[1:]],
                             env=env, cwd=tmp, capture_output=True, text=True, timeout=30).stdout.strip()
        end = time.time() + args.timeout
        target = os.path.join(ckpt, f"ckpt-{args.kill_at:08d}.h5")
        while not os.path.exists(target) and time.time() < end:
            time.sleep(0.05)
        t_fail = time.time()
        lost = subprocess.run(["bash", script, "lose-node", root, "n2"], env=env, capture_output=True, text=True,
                              timeout=30)
        if lost.returncode:
            raise SystemExit(f"recovery.py: lose-node failed:\n{lost.stdout}{lost.stderr}")
        arrived: dict[str, float] = {}

        def lines():
            try:
                with open(out, errors="replace") as fh:
                    for line in fh:
                        arrived.setdefault(line.rstrip(), time.time())
            except OSError:
                pass
            return [(t, line) for line, t in arrived.items()]
        row = _await_recovery(lines, t_fail, end, lambda: None)
        if row is None:
            raise SystemExit(f"recovery.py: node {model}: no recovery line (output:\n"
                             + "\n".join(line for _, line in lines()[-40:]) + ")")
        # the first failure line of the job is the node's (nothing failed before the crash)
        return dict(row, case="node", model=model, ranks=2 * max(1, args.ranks // 2), killed_after_step=args.kill_at,
                    lines=[line for _, line in lines() if line.startswith("hpctrain launch: ")])
    finally:
        if job:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
        subprocess.run(["bash", script, "revive-node", root, "n2"], env=env, capture_output=True, timeout=60)
        subprocess.run(["bash", script, "stop", root], env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["rank", "stop"], choices=["rank", "stop", "node"],
                   help="rank: kill -9 of rank 1; stop: SIGSTOP of rank 1; node: a whole node crashes on the local "
                        "SLURM cluster (root and SLURM needed)")
    p.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    p.add_argument("--ranks", type=int, default=2, help="ranks (node: split over 2 nodes)")
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps (default 20)")
    p.add_argument("--kill-at", type=int, default=40, help="fail once the checkpoint of this step exists")
    p.add_argument("--mpirun-args", default="--oversubscribe", help="mpirun options (default --oversubscribe)")
    p.add_argument("--mlp-data", default="", help="the MLP's training file (default: made, 65,536 rows)")
    p.add_argument("--text", default="", help="the GPT's token file (default: made from the standard library)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per row before giving up")
    p.add_argument("--json", default="runs/bench/recovery.json")
    args = p.parse_args()
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (rank 1 is the one failed; node: one per node)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpctrain-recovery-") as tmp:
        made = {}
        for model in args.models:
            data = args.mlp_data if model == "mlp" else args.text
            if not data:
                data = os.path.join(tmp, f"{model}.h5")
                cmd = (_hpctrain("data", "synth", "--out", data, "--n", "65536", "--seed", "1") if model == "mlp"
                       else _hpctrain("data", "text", "--out", data))
                subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            made[model] = data
        for case in args.cases:
            for model in args.models:
                rows.append(node_crash(model, made[model], args, tmp) if case == "node"
                            else measure(case, model, made[model], args, tmp))
    print(f"\nRecovery after a failure ({platform.node()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; checkpoint every {args.every} steps, failed after the one of step "
          f"{args.kill_at}); seconds:\n")
    print("| case | model | ranks | detection | tear-down | node probes | start-up | load + set-up | first step | "
          f"total | total, this clock | redone steps | < {TARGET_S:g} s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")

    def s(row, key):
        return f"{row[key]:.1f}" if key in row else "-"
    for r in rows:
        print(f"| {r['case']} | {r['model']} | {r['ranks']} | {s(r, 'detect_s')} | {s(r, 'teardown_s')} | "
              f"{s(r, 'probes_s')} | {s(r, 'startup_s')} | {s(r, 'load_s')} | {s(r, 'first_step_s')} | "
              f"{r['total_s']:.1f} | {r['total_by_clock_s']:.1f} | {r['redone']} | "
              f"{'yes' if max(r['total_s'], r['total_by_clock_s']) < TARGET_S else 'NO'} |")
    print("\nThe launcher's lines:")
    for r in rows:
        print(f"\n{r['case']}, {r['model']}:")
        print("\n".join("  " + line[:300] for line in r["lines"] if not line.startswith(("hpctrain launch: start:",
                                                                                         "hpctrain launch: heartbeats"))))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"benchmark": "recovery", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(),
                   "cores": os.cpu_count(), "every": args.every, "kill_at": args.kill_at, "target_s": TARGET_S,
                   "rows": rows}, fh, indent=1)
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()

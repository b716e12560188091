"""What a failure costs under ``python -m hpctrain launch``: kill -9 of one rank, then the restart.

    python benchmarks/recovery.py                          # the example MLP and GPT, 2 ranks
    python benchmarks/recovery.py --models gpt --ranks 4 --kill-at 60 --json runs/bench/recovery.json

Per model: the launcher starts training (checkpoint every --every steps); when the checkpoint
of step --kill-at exists, rank 1 gets SIGKILL. From the launcher's own lines, timed as they
arrive, the run is split into

  detect + tear-down  from the kill to the failed job's end (mpirun sees the dead rank,
                      ends the others, exits): the launcher prints "failure 1" then;
  start-up            from that end to the restarted trainer's start (mpirun, Python,
                      imports, MPI_Init);
  load + set-up       the checkpoint load and the trainer's set-up;
  first step          the first new step (compilation and caches warm up here);
  total               kill to the first new step: the recovery time, target < 30 s;
  redone              steps between the checkpoint and the failure, computed again.

Then the launcher gets SIGTERM: the ranks save and stop (exit 75). Data are made in a
temporary folder unless --mlp-data / --text name files. Prints a table, writes JSON.
Rank 1 is found by Open MPI's OMPI_COMM_WORLD_RANK (mpirun from Open MPI).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 30.0
RECOVERED = re.compile(r"recovered: first new step ([\d.]+) s after the failed job ended \(start-up ([\d.]+) s, "
                       r"checkpoint load and set-up ([\d.]+) s, first step ([\d.]+) s\); resumed at step (\d+), "
                       r"(\d+) step\(s\) redone")


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


def measure(model, data, args, tmp):
    ckpt = os.path.join(tmp, f"ck-{model}")
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
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"recovery.py: {model}: no checkpoint of step {args.kill_at} or no rank 1 "
                         f"(output:\n" + "\n".join(line for _, line in lines[-30:]) + ")")
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    row = None
    while time.time() < end and proc.poll() is None:
        failed = [t for t, line in lines if "hpctrain launch: failure 1:" in line]
        got = [RECOVERED.search(line) for _, line in lines]
        got = [m for m in got if m]
        if failed and got:
            total, start, load, first, resumed, redone = got[0].groups()
            detect = failed[0] - t_kill
            row = {"model": model, "ranks": args.ranks, "detect_s": detect, "startup_s": float(start),
                   "load_s": float(load), "first_step_s": float(first), "total_s": detect + float(total),
                   "resumed_at": int(resumed), "redone": int(redone), "killed_after_step": args.kill_at}
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the launcher passes SIGUSR1 on: save, exit 75
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=5)
    if row is None:
        raise SystemExit(f"recovery.py: {model}: no recovery line (output:\n"
                         + "\n".join(line for _, line in lines[-40:]) + ")")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps (default 20)")
    p.add_argument("--kill-at", type=int, default=40, help="kill rank 1 once the checkpoint of this step exists")
    p.add_argument("--mpirun-args", default="--oversubscribe", help="mpirun options (default --oversubscribe)")
    p.add_argument("--mlp-data", default="", help="the MLP's training file (default: made, 65,536 rows)")
    p.add_argument("--text", default="", help="the GPT's token file (default: made from the standard library)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per model before giving up")
    p.add_argument("--json", default="runs/bench/recovery.json")
    args = p.parse_args()
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (rank 1 is the one killed)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpctrain-recovery-") as tmp:
        for model in args.models:
            data = args.mlp_data if model == "mlp" else args.text
            if not data:
                data = os.path.join(tmp, f"{model}.h5")
                made = (_hpctrain("data", "synth", "--out", data, "--n", "65536", "--seed", "1") if model == "mlp"
                        else _hpctrain("data", "text", "--out", data))
                subprocess.run(made, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            rows.append(measure(model, data, args, tmp))
    print(f"\nRecovery after kill -9 of rank 1 ({platform.node()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; checkpoint every {args.every} steps, killed after the one of step "
          f"{args.kill_at}); seconds:\n")
    print("| model | ranks | detect + tear-down | start-up | load + set-up | first step | total | redone steps | "
          f"< {TARGET_S:g} s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['ranks']} | {r['detect_s']:.1f} | {r['startup_s']:.1f} | {r['load_s']:.1f} | "
              f"{r['first_step_s']:.1f} | {r['total_s']:.1f} | {r['redone']} | "
              f"{'yes' if r['total_s'] < TARGET_S else 'NO'} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"benchmark": "recovery", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(),
                   "cores": os.cpu_count(), "every": args.every, "kill_at": args.kill_at, "target_s": TARGET_S,
                   "rows": rows}, fh, indent=1)
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()

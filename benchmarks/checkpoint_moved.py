"""Bytes a checkpoint save moves between ranks, counted by MPI itself, against the bytes it writes.

    python benchmarks/checkpoint_moved.py --ranks 4 --layouts zero3 p2t2 zero0   # launches mpirun itself
    python benchmarks/checkpoint_moved.py --ranks 2 --layouts zero1 --n-layer 2 --d-model 128   # quick

For each layout, two mpirun jobs of ``--ranks`` ranks under Open MPI's message monitoring
(``--mca pml_monitoring_enable 2``: every point-to-point and collective message, MPI-IO's included,
counted per pair of ranks at the PML and written out at MPI_Finalize) build the same GPT trainer
and take one step; the second then saves a checkpoint (synchronously; a background save sends the
same messages from its thread). The difference of the two jobs' byte counts is what the save moved;
beside it, the bytes the ranks wrote (parameters and optimizer state) and the dataset count (each
dataset's CRC travels once per rank in the save's XOR all-reduce). The yardstick, in the same
way: a third job that all-gathers each rank's written bytes instead of saving (what a save that
gathers the state moves; it also checks that the monitoring sees large messages).

Needs Open MPI with its monitoring components (``ompi_info | grep monitoring``). Prints a table;
writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MONITORING = ["--mca", "pml_monitoring_enable", "2", "--mca", "pml_monitoring_enable_output", "3"]


def parse_args(argv=None):
    from checkpoint_training import LAYOUTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layouts", nargs="+", default=["zero3", "p2t2", "zero0"], choices=sorted(LAYOUTS))
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--text", default=os.path.join(REPO, "data", "text.h5"), help="token file (made if missing)")
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "checkpoint_moved.json"))
    p.add_argument("--inner", choices=["save", "nosave", "gather"], help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def inner(args) -> int:
    """One monitored job: a trainer of ``args.layout``, one step, then a save or not; rank 0 prints
    the bytes written and the dataset count as one JSON line."""
    from hpctrain.runtime import init_world, limit_threads_per_rank, yield_when_oversubscribed

    limit_threads_per_rank()      # before numpy, as the trainer's command does
    yield_when_oversubscribed()
    import numpy as np

    from checkpoint_training import config, trainer_of
    from hpctrain.ckpt.state import training_state

    world = init_world()
    bench = argparse.Namespace(n_layer=args.n_layer, d_model=args.d_model, context=64, text=args.text)
    trainer = trainer_of(config(bench, args.layout, args.dir, 1), world)
    trainer.run()
    entries = training_state(trainer.state, trainer.plan)
    writes = sum(int(np.prod(c)) * e.dtype.itemsize for e in entries if e.pieces is not None for _, c, _ in e.pieces)
    world.comm.Barrier()
    if args.inner == "save":
        trainer.checkpoints.save(trainer.state)
    elif args.inner == "gather":
        sizes = world.comm.allgather(writes)
        got = np.empty(sum(sizes), np.uint8)
        world.comm.Allgatherv(np.zeros(writes, np.uint8), [got, sizes])
    world.comm.Barrier()
    trainer.close(0)
    total = world.comm.allreduce(writes)
    if world.rank == 0:
        print(json.dumps({"written": total, "datasets": len(entries)}), flush=True)
    return 0


def monitored(args, layout: str, what: str, work: str) -> tuple[int, dict]:
    """Run one inner job; (bytes every rank sent, counted by the monitoring), what rank 0 printed."""
    prefix = os.path.join(work, f"{layout}-{what}")
    ckpt = os.path.join(work, f"ckpt-{layout}-{what}")
    os.makedirs(ckpt, exist_ok=True)
    cmd = ["mpirun", "-n", str(args.ranks), "--oversubscribe", *MONITORING, "--mca", "pml_monitoring_filename",
           prefix, sys.executable, os.path.abspath(__file__), "--inner", what, "--layout", layout, "--dir", ckpt,
           "--n-layer", str(args.n_layer), "--d-model", str(args.d_model), "--text", args.text]
    from scaling import SINGLETON_VARS   # a caller that initialised MPI as a singleton (a test process) leaves
    # variables that make a nested mpirun exit 1 without a word
    env = {k: v for k, v in os.environ.items() if not k.startswith(SINGLETON_VARS)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"checkpoint_moved: {' '.join(cmd)} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    files = glob.glob(prefix + ".*.prof")
    if len(files) != args.ranks:
        raise SystemExit(f"checkpoint_moved: {len(files)} monitoring files for {args.ranks} ranks (is Open MPI's "
                         f"pml monitoring built? ompi_info | grep monitoring)")
    sent = 0
    for path in files:
        with open(path) as fh:
            for line in fh:
                if line[:1] in "EI":   # E: the user's point-to-point, I: collectives' internal messages
                    sent += int(re.search(r"(\d+) bytes", line).group(1))
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return sent, report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.inner:
        return inner(args)
    if shutil.which("ompi_info") is None:
        raise SystemExit("checkpoint_moved: needs Open MPI (its pml monitoring counts the messages)")
    if not os.path.exists(args.text):
        os.makedirs(os.path.dirname(args.text), exist_ok=True)
        subprocess.run([sys.executable, "-m", "hpctrain", "data", "text", "--out", args.text], cwd=REPO, check=True)
    work = tempfile.mkdtemp(prefix="ckpt-moved-")
    rows = []
    try:
        for layout in args.layouts:
            without, _ = monitored(args, layout, "nosave", work)
            with_save, report = monitored(args, layout, "save", work)
            gathered, _ = monitored(args, layout, "gather", work)
            rows.append({"layout": layout, "moved": with_save - without, "gather": gathered - without, **report})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"bytes a save moves between ranks (Open MPI pml monitoring, {args.ranks} ranks, GPT n_layer "
          f"{args.n_layer} d_model {args.d_model}, AdamW float32; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print("| layout | datasets | written MiB | moved by the save KiB | moved / written | an all-gather of the "
          "written bytes MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['datasets']} | {r['written'] / 2**20:.1f} | {r['moved'] / 2**10:.1f} | "
              f"{r['moved'] / r['written']:.5f} | {r['gather'] / 2**20:.1f} |")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"ranks": args.ranks, "n_layer": args.n_layer, "d_model": args.d_model, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

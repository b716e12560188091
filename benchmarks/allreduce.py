"""All-reduce bandwidth per strategy against MPI_Allreduce, nccl-tests style.

    mpirun -n 4 python benchmarks/allreduce.py                      # 4 KB .. 256 MB, x4
    mpirun -n 4 python benchmarks/allreduce.py --max 64M --strategies naive,ring
    benchmarks/emulated_cluster.sh -- .venv/bin/python benchmarks/allreduce.py --max 64M

Every strategy in ``hpctrain.comm.STRATEGIES`` (read at run time, so new ones
appear here without edits) and MPI's own ``comm.Allreduce`` (the yardstick row)
run at every size in the same job. Per size and strategy:

1. validate once: x = rank + (index mod 1024), op sum, compared element by
   element with the closed form size*(index mod 1024) + size*(size-1)/2. The
   period keeps every partial sum an integer below 2^24, so the answer is exact
   in float32 whatever order an algorithm adds in (the oracle is this formula,
   not the naive strategy, so naive is checked too). A strategy with #wrong > 0
   is not timed, and the script exits 1 after the table.
2. warm up, then time: Barrier, Wtime around one call, per iteration; an
   iteration's time is the max over ranks (the collective ends when its
   slowest rank does). Report median, min and max. Strategies take turns
   call by call, so load from elsewhere on the machine hits all alike. Timed
   calls reduce zeros, so repeated in-place sums cannot overflow to inf.

algbw = size / time; busbw = algbw * 2(n-1)/n, the bytes each rank must move
through its link in a bandwidth-optimal all-reduce, so busbw is comparable
across rank counts and against the link's speed (nccl-tests' definition).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARDSTICK = "MPI_Allreduce"
PERIOD = 1024  # see the docstring: keeps closed-form sums exact in float32


def parse_size(text: str) -> int:
    """'4K', '256M', '1G' (binary units, as nccl-tests) or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def human(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min", type=parse_size, default=parse_size("4K"), help="smallest size, bytes (4K)")
    p.add_argument("--max", type=parse_size, default=parse_size("256M"), help="largest size, bytes (256M)")
    p.add_argument("--factor", type=int, default=4, help="size step (4x, as the issue asks)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--strategies", default="", help="comma-separated names (default: all registered)")
    p.add_argument("--ranks-per-node", type=int, default=0, help="simulate nodes of K ranks (0: real topology)")
    p.add_argument("--iters", type=int, default=20, help="timed calls at small sizes")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls at small sizes")
    # 20 iterations of 256 MB on 2 cores would take minutes per strategy: large
    # sizes get budget/size iterations instead, never fewer than 3 (a median).
    p.add_argument("--budget", type=parse_size, default=parse_size("256M"),
                   help="bytes reduced per strategy and size, bounding iterations at large sizes")
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "allreduce.json"))
    p.add_argument("--plot", default="", help="PNG of busbw vs size (needs matplotlib)")
    return p.parse_args(argv)


def iterations(args, size: int) -> tuple[int, int]:
    """(warm-up, timed) calls for one size: the defaults, cut down when size is large."""
    iters = max(3, min(args.iters, args.budget // size))
    warmup = max(1, min(args.warmup, args.budget // (4 * size)))
    return warmup, iters


def machine_id() -> str:
    """The physical machine: namespaces of an emulated cluster share its boot id, not its hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return platform.node()


def topology(world, MPI) -> dict:
    """Hostnames per rank and node count, so every table says where it ran."""
    names = world.comm.allgather(MPI.Get_processor_name())
    machines = world.comm.allgather(machine_id())
    cores = os.cpu_count() or 1
    return {"ranks": world.size, "n_nodes": world.n_nodes, "hostnames": names,
            "node_of_rank": world.comm.allgather(world.node_rank), "local_size": world.local_size,
            "cores_per_machine": cores,
            # more ranks than cores on a machine: every rank waits for descheduled peers
            "oversubscribed": any(machines.count(m) > cores for m in set(machines)),
            # other jobs on the same cores stretch every time; the reader should know
            "loadavg_1min_at_start": os.getloadavg()[0],
            "mpi": MPI.Get_library_version().split("\0")[0].splitlines()[0].strip(),
            "python": platform.python_version()}


def validate(world, MPI, np, reduce, count, dtype, alloc=None) -> int:
    """Wrong elements, summed over ranks, after one sum of x = rank + (index mod PERIOD)
    (in a buffer from ``alloc(count, dtype)`` when given)."""
    n, comm = world.size, world.comm
    pattern = np.arange(PERIOD, dtype=np.float64)
    buf = np.resize((pattern + world.rank).astype(dtype), count)
    if alloc is not None:
        target = alloc(count, dtype)
        target[:] = buf
        buf = target
    reduce(buf)
    expected = np.resize((n * pattern + n * (n - 1) / 2).astype(dtype), count)
    return comm.allreduce(int(np.count_nonzero(buf != expected)), op=MPI.SUM)


def measure(world, MPI, np, reducers, size, dtype, args, allocs=None) -> list[dict]:
    """Rows for every reducer at ``size`` bytes: validate each, then time the valid ones.

    ``allocs[name](count, dtype)``: where that reducer's buffer lives (shm's
    zero-copy row reduces a slice of its shared window); others use a plain array.

    Timed calls take turns (strategy A, B, ..., A, B, ...) so that a change in
    the machine's load during the run hits every strategy alike, not one.
    """
    n, comm = world.size, world.comm
    count = size // np.dtype(dtype).itemsize
    allocs = allocs or {}
    wrong = {name: validate(world, MPI, np, reduce, count, dtype, allocs.get(name))
             for name, reduce in reducers.items()}
    timed = [name for name in reducers if not wrong[name]]  # an invalid result is not worth timing
    plain = np.zeros(count, dtype)
    bufs = {name: allocs[name](count, dtype) if name in allocs else plain for name in timed}
    for buf in bufs.values():
        buf[:] = 0
    warmup, iters = iterations(args, size)
    for name in timed:
        for _ in range(warmup):
            reducers[name](bufs[name])
    times = np.empty((len(timed), iters))
    for i in range(iters):
        for j, name in enumerate(timed):
            comm.Barrier()  # all ranks start together, so one late rank is not timed as slow network
            t0 = MPI.Wtime()
            reducers[name](bufs[name])
            times[j, i] = MPI.Wtime() - t0
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # once, after timing, not inside the loop
    rows = []
    for name in reducers:
        row = {"strategy": name, "size": size, "count": count, "dtype": dtype, "wrong": wrong[name],
               "time_us": None, "min_us": None, "max_us": None, "algbw": None, "busbw": None}
        if name in timed:
            t = times[timed.index(name)]
            algbw = size / float(np.median(t)) / 1e9
            row.update(time_us=float(np.median(t)) * 1e6, min_us=float(t.min()) * 1e6,
                       max_us=float(t.max()) * 1e6, iters=iters, warmup=warmup,
                       algbw=algbw, busbw=algbw * 2 * (n - 1) / n)
        rows.append(row)
    return rows


def us(t: float) -> str:
    return f"{t:.1f}" if t < 100 else f"{t:.0f}"  # keep 3 significant digits at small times


def table(rows, info) -> str:
    """Markdown table; 'x MPI' is busbw over the MPI_Allreduce row of the same size."""
    ref = {r["size"]: r["busbw"] for r in rows if r["strategy"] == YARDSTICK}
    lines = [f"all-reduce sum, {info['ranks']} ranks on {info['n_nodes']} node(s), {rows[0]['dtype']}"
             + (" (oversubscribed: more ranks than cores)" if info["oversubscribed"] else "")
             + f"; load average {info['loadavg_1min_at_start']:.1f} at start", "",
             "| size (B) | count | dtype | strategy | time_us median | min | max | algbw GB/s | busbw GB/s | x MPI | #wrong |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["time_us"] is None:
            cells = ["-"] * 6
        else:
            x = r["busbw"] / ref[r["size"]] if ref.get(r["size"]) else float("nan")
            cells = [us(r["time_us"]), us(r["min_us"]), us(r["max_us"]),
                     f"{r['algbw']:.3f}", f"{r['busbw']:.3f}", f"{x:.2f}"]
        lines.append(f"| {r['size']} ({human(r['size'])}) | {r['count']} | {r['dtype']} | {r['strategy']}{' -> ' + r['picked'] if 'picked' in r else ''} | "
                     + " | ".join(cells) + f" | {r['wrong']} |")
    return "\n".join(lines)


def plot(rows, info, path: str) -> str:
    """PNG of busbw vs size per strategy; returns what happened, for the log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib, or setup.cfg extra 'plot')"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["strategy"] for r in rows):
        pts = [(r["size"], r["busbw"]) for r in rows if r["strategy"] == name and r["busbw"]]
        ax.plot(*zip(*pts), marker="o", label=name, linestyle="--" if name == YARDSTICK else "-")
    ax.set(xscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)", title=f"all-reduce busbw, {info['ranks']} ranks on {info['n_nodes']} node(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return f"plot: {path}"


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, REPO)
    from hpctrain.runtime import limit_threads_per_rank

    limit_threads_per_rank()  # before numpy: one BLAS/numba thread pool per core, not per rank
    import numpy as np

    from hpctrain import comm
    from hpctrain.device import CpuDevice
    from hpctrain.errors import UserError
    from hpctrain.runtime import init_world

    world = init_world(ranks_per_node=args.ranks_per_node)
    from mpi4py import MPI

    # auto is built by make_allreduce (it times the others), so STRATEGIES does not list it
    known = sorted(comm.STRATEGIES) + (["auto"] if hasattr(comm, "AutoAllreduce") else [])
    names = [s for s in args.strategies.split(",") if s] or known
    unknown = [s for s in names if s not in known]
    sizes = []
    size = args.min
    while size <= args.max:
        sizes.append(size)
        size *= args.factor
    error = (f"unknown strategies {unknown}; registered: {', '.join(known)}" if unknown
             else "no sizes: --min must be <= --max and --factor >= 2" if not sizes or args.factor < 2 else "")
    if error:  # the same verdict on every rank: print once, exit non-zero everywhere
        if world.is_root:
            print(f"allreduce.py: error: {error}", file=sys.stderr)
        return 2

    info = topology(world, MPI)
    device = CpuDevice(args.dtype)
    in_place, total = MPI.IN_PLACE, MPI.SUM
    if world.is_root:
        by_node = {}
        for r, h in enumerate(info["hostnames"]):
            by_node.setdefault(f"node {info['node_of_rank'][r]} ({h})", []).append(r)
        print(f"topology: {world.size} ranks, n_nodes={world.n_nodes}: "
              + "; ".join(f"{k}: ranks {v}" for k, v in by_node.items()), flush=True)
        print(f"{info['mpi']}; strategies: {', '.join(names + [YARDSTICK])}; validation: closed form "
              f"x = rank + (index mod {PERIOD}), op sum", flush=True)

    reducers, pickers, allocs = {}, {}, {}
    for name in names:
        try:
            strategy = comm.make_allreduce(name, world, device)  # collective (auto measures here)
        except UserError as exc:  # shm across nodes: the same verdict on every rank
            if world.is_root:
                print(f"{name}: skipped: {exc}", flush=True)
            continue
        reducers[name] = lambda buf, strategy=strategy: strategy(buf, "sum")
        if hasattr(strategy, "allocate"):  # shm, auto on one machine: also as the trainer uses them, in their window
            window = strategy.allocate(max(sizes) // np.dtype(args.dtype).itemsize, args.dtype)
            reducers[name + " zero-copy"] = reducers[name]
            allocs[name + " zero-copy"] = lambda count, dtype, window=window: window[:count]
        if hasattr(strategy, "choose"):  # auto: the table says which strategy it ran per size
            pickers[name] = strategy.choose
            if name + " zero-copy" in reducers:
                pickers[name + " zero-copy"] = lambda size, strategy=strategy: strategy.choose(size, zero_copy=True)
            if world.is_root:
                print(f"{name}: {strategy.describe()}", flush=True)
    reducers[YARDSTICK] = lambda buf: world.comm.Allreduce(in_place, buf, op=total)
    rows = []
    t_start = time.time()
    for size in sizes:
        rows += measure(world, MPI, np, reducers, size, args.dtype, args, allocs)
        for row in rows[-len(reducers):]:
            if row["strategy"] in pickers:
                row["picked"] = pickers[row["strategy"]](size)
        if world.is_root:
            print(f"  {human(size)} done ({time.time() - t_start:.0f} s)", file=sys.stderr, flush=True)

    if world.is_root:
        print(table(rows, info))
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.node(),
                       "args": vars(args), "topology": info, "rows": rows},
                      fh, indent=1)
        print(f"json: {args.json}")
        if args.plot:
            print(plot(rows, info, args.plot))
    bad = sorted({r["strategy"] for r in rows if r["wrong"]})
    if bad and world.is_root:
        print(f"allreduce.py: FAIL: wrong results from {', '.join(bad)} (column #wrong)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

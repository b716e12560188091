"""Checkpoint save and load against raw NumPy file I/O on the same filesystem, in the same run.

    mpirun -n 2 python benchmarks/checkpoint.py                      # 64M, 256M, 1G, 2G of state
    mpirun -n 4 --oversubscribe python benchmarks/checkpoint.py --sizes 64M,256M --collective
    python benchmarks/checkpoint.py --sizes 1M --repeats 1           # 1 rank, no launcher

Sizes are binary (1G = 2^30 B), GB/s decimal (10^9 B/s). The state, the same on
every rank, is shaped like ``ckpt.state.training_state`` with AdamW (see
``synthetic_state``). Per repeat the ops take turns, so load from elsewhere on
the machine hits all alike:

  raw write    rank 0 alone: ndarray.tofile of every array into one file, fsync (save's yardstick)
  raw pwrite   every rank os.pwrite's its rows (row_range) into one file, fsync (2+ ranks)
  save         write_checkpoint: parallel HDF5 (mpio) with writeback started after each piece, CRC-32,
               close, one fsync per node, rename, dir fsync; "save coll.": the same with
               collective=True (--collective); --writers-per-node k: k ranks per node write the data
  raw read     rank 0 alone: np.fromfile of the raw file (load's yardstick)
  raw pread    every rank os.preadv's its rows, then Allgatherv: load without HDF5 and CRC (2+ ranks)
  load         load_checkpoint: every rank reads its rows, CRC-32 check, Allgatherv of every array

Each op starts after a Barrier; its time is the max over ranks. Before each op
the benchmark's files leave the page cache (``uncache``), so reads come from the
disk, ours and the yardstick's alike. Files are deleted before a rewrite (not
timed) and at the end. Each size starts with an untimed round of every op whose
reads must equal the state (#wrong > 0 exits 1 after the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from allreduce import human, parse_size  # the same size grammar as the all-reduce benchmark

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 4096  # row width of the synthetic weights: 16 KB rows
LAYERS = 4    # matrices per group: 3 groups x 4 = 12 large arrays, none over 1/12 of the state
GROUPS = ("model", "optim/exp_avg", "optim/exp_avg_sq")  # the paths of an AdamW checkpoint
TARGET = 0.8  # save >= 0.8x the raw sequential write
WRITES = ("raw write", "raw pwrite", "save", "save coll.")  # x raw: over raw write; the rest over raw read


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64M,256M,1G,2G", help="state sizes, comma-separated (64M,256M,1G,2G)")
    p.add_argument("--dir", default=os.path.join(REPO, "runs", "bench", "ckpt-bench"), help="where to write")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per size (3: a median)")
    p.add_argument("--collective", action="store_true", help="also time collective MPI-IO writes")
    p.add_argument("--writers-per-node", type=int, default=0,
                   help="ranks per node that write the save's data, the others send them their rows "
                        "(checkpoint.writers_per_node; default 0 = every rank writes, the config's default)")
    p.add_argument("--keep-cache", action="store_true", help="leave files in the page cache (hot reads)")
    p.add_argument("--json", default=os.path.join(REPO, "runs", "bench", "checkpoint.json"))
    return p.parse_args(argv)


def training_attrs() -> dict:
    """The root attributes a training run stores with the AdamW state above (the readers check a
    training checkpoint's attributes against its stored config)."""
    from hpctrain.training.config import Config

    cfg = Config()
    cfg.optim.name = "adamw"
    return {"epoch": 0, "config": cfg.to_toml(), "optimizer": "adamw", "dtype": "float32", "compress": "none",
            "compress_scope": "all"}


def synthetic_state(np, nbytes: int, rank: int):
    """(arrays by path, this rank's RNG row, Entries): model and two moments, LAYERS float32
    matrices of WIDTH-wide rows and a bias each, about ``nbytes`` in all; step count, data
    position, a per-rank RNG row. Values differ per array and row (exact in float32), so a
    slice written to or read from the wrong place fails validation."""
    from hpctrain.ckpt.state import Entry

    n_mats = len(GROUPS) * LAYERS
    rows = max(n_mats, (nbytes - n_mats * WIDTH * 4 - 56) // (WIDTH * 4))  # 56: the int64 arrays below
    arrays = {}
    for k in range(n_mats):
        path = f"/{GROUPS[k // LAYERS]}/fc{k % LAYERS}"
        row_id = np.arange(rows // n_mats + (k < rows % n_mats), dtype=np.float32)
        w = np.arange(WIDTH, dtype=np.float32) + (row_id % 1021 + 1021 * k)[:, None]  # (rows, WIDTH)
        arrays[path + "/weight"], arrays[path + "/bias"] = w, np.arange(WIDTH, dtype=np.float32) - k
    arrays["/optim/step_count"] = np.array([1000], np.int64)
    # global step 1 (the file's step), epoch 0, step in epoch 1, the default config's batch and seed
    arrays["/data/position"] = np.array([1, 0, 1, 256, 1234, 65536], dtype=np.int64)
    entries = [Entry(p, a.shape, a.dtype, lambda lo, hi, a=a: a[lo:hi]) for p, a in arrays.items()]
    rng = np.arange(6, dtype=np.uint64) + np.uint64(rank)
    entries.append(Entry("/rng/pcg64", (None, 6), rng.dtype, lambda lo, hi: rng[None], per_rank=True))
    return arrays, rng, entries


def byte_rows(a, rank: int, size: int):
    """(``rank``'s rows of ``a`` as a uint8 view, their byte offset in ``a``): the checkpoint's split."""
    from hpctrain.ckpt.format import row_range

    lo, hi = row_range(a.shape[0], rank, size)
    row = a.nbytes // a.shape[0]
    return a.reshape(-1).view("u1")[lo * row:hi * row], lo * row


def raw_write(path, arrays):
    with open(path, "wb") as fh:
        for a in arrays.values():
            a.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())


def raw_read(np, path, arrays):
    with open(path, "rb") as fh:
        return {p: np.fromfile(fh, a.dtype, a.size).reshape(a.shape) for p, a in arrays.items()}


def raw_pwrite(world, path, arrays):
    if world.rank == 0:
        open(path, "wb").close()
    world.comm.Barrier()  # the file exists before any rank opens it
    fd, offset = os.open(path, os.O_WRONLY), 0
    for a in arrays.values():
        buf, at = byte_rows(a, world.rank, world.size)
        while len(buf):  # one call moves at most ~2 GB on Linux
            n = os.pwrite(fd, buf, offset + at)
            buf, at = buf[n:], at + n
        offset += a.nbytes
    os.fsync(fd)
    os.close(fd)


def raw_pread(np, world, MPI, path, arrays):
    fd, offset, out = os.open(path, os.O_RDONLY), 0, {}
    for p, a in arrays.items():
        out[p] = full = np.empty_like(a)
        buf, at = byte_rows(full, world.rank, world.size)
        while len(buf):
            n = os.preadv(fd, [buf], offset + at)
            buf, at = buf[n:], at + n
        parts = [byte_rows(full, r, world.size) for r in range(world.size)]
        world.comm.Allgatherv(MPI.IN_PLACE, [full.reshape(-1).view("u1"), [len(b) for b, _ in parts],
                                             [at for _, at in parts], MPI.BYTE])
        offset += a.nbytes
    os.close(fd)
    return out


def uncache(world, keep: bool, paths) -> bool:
    """Evict ``paths`` from every node's page cache (posix_fadvise DONTNEED); True if it worked.

    Not drop_caches: that needs root and evicts numpy's, h5py's and libhdf5's code too, which
    the next timed op reads back from disk, a cost falling on HDF5's larger code more."""
    world.comm.Barrier()  # no rank is still writing
    ok = True
    if not keep and world.local_rank == 0:  # the page cache is per node
        try:
            for path in [p for p in paths if os.path.exists(p)]:
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)  # DONTNEED skips dirty pages
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        except OSError:
            ok = False
    return all(world.comm.allgather(ok)) and not keep


def machine(np, world, MPI, directory: str, evict: bool) -> dict:
    import h5py

    try:  # df names the filesystem type; os.statvfs cannot
        dev, kind = subprocess.run(["df", "-PT", directory], capture_output=True, text=True,
                                   timeout=10).stdout.splitlines()[1].split()[:2]
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        dev, kind = "?", "unknown type (df failed)"
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return {"host": platform.node(), "cores": os.cpu_count(), "memory_gb": round(mem_gb, 1), "ranks": world.size,
            "oversubscribed": world.local_size > (os.cpu_count() or 1), "loadavg_1min_at_start": os.getloadavg()[0],
            "mpi": MPI.Get_library_version().split("\0")[0].splitlines()[0].split(",")[0].strip(),
            "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version, "h5py_mpi": bool(h5py.get_config().mpi),
            "numpy": np.__version__, "dir": directory, "filesystem": f"{kind} on {dev}", "cache_evicted": evict}


def machine_line(m) -> str:
    return (f"machine: {m['host']}, {m['cores']} cores, {m['memory_gb']:.0f} GB, {m['ranks']} ranks"
            + (" (oversubscribed)" if m["oversubscribed"] else "") + f", load average "
            f"{m['loadavg_1min_at_start']:.1f}; {m['mpi']}; h5py {m['h5py']}, HDF5 {m['hdf5']}, h5py MPI: "
            f"{'yes' if m['h5py_mpi'] else 'no (rank 0 writes alone)'}; --dir {m['dir']}: {m['filesystem']}; "
            f"our files evicted from the page cache before every op: {'yes' if m['cache_evicted'] else 'NO'}")


def measure(np, world, MPI, size: int, args, info) -> tuple[list[dict], int]:
    """Rows of every op at ``size`` bytes of state, and the number of wrong arrays the warm-up reads gave."""
    from hpctrain.ckpt.read import load_checkpoint
    from hpctrain.ckpt.write import write_checkpoint

    comm, root = world.comm, world.is_root
    arrays, rng, entries = synthetic_state(np, size, world.rank)
    nbytes = sum(a.nbytes for a in arrays.values()) + rng.nbytes * world.size
    raw, ckpt = os.path.join(args.dir, "raw.bin"), os.path.join(args.dir, "ckpt-00000001.h5")
    attrs, wpn = training_attrs(), args.writers_per_node
    ops = {"raw write": (raw, (lambda: raw_write(raw, arrays)) if root else (lambda: None)),
           "raw pwrite": (raw, lambda: raw_pwrite(world, raw, arrays)),
           "save": (ckpt, lambda: write_checkpoint(args.dir, 1, entries, attrs, world, writers_per_node=wpn)),
           "save coll.": (ckpt, lambda: write_checkpoint(args.dir, 1, entries, attrs, world, collective=True,
                                                         writers_per_node=wpn)),
           "raw read": (None, (lambda: raw_read(np, raw, arrays)) if root else (lambda: None)),
           "raw pread": (None, lambda: raw_pread(np, world, MPI, raw, arrays)),
           "load": (None, lambda: load_checkpoint(ckpt, world))}
    names = [n for n in ops if (world.size > 1 or "raw p" not in n) and (args.collective or n != "save coll.")]
    times, wrong = np.zeros((len(names), args.repeats)), 0
    for i in range(-1, args.repeats):  # -1: warm-up (first touch of memory and page cache) and validation
        for j, name in enumerate(names):
            target, op = ops[name]
            if root and target and os.path.exists(target):
                os.remove(target)  # a rewrite would pay for deleting the old file (ext4 with discard)
            info["cache_evicted"] &= uncache(world, args.keep_cache, (raw, ckpt))
            comm.Barrier()  # all ranks start together
            t0 = MPI.Wtime()
            result = op()
            times[j, max(i, 0)] = MPI.Wtime() - t0  # the warm-up's time is overwritten
            if i == -1 and name in ("raw read", "raw pread", "load"):  # validate, the yardsticks too
                got = result.full if name == "load" else result or arrays  # raw read: None off rank 0
                bad = [p for p, a in arrays.items() if not np.array_equal(got.get(p), a)]
                bad += [] if name != "load" or np.array_equal(result.own_rows.get("/rng/pcg64"), rng) else ["rng"]
                wrong += comm.allreduce(len(bad))
            del result  # the next op must not find this op's arrays still in memory
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # once, after timing: an op ends with its slowest rank
    rows = [{"size": size, "bytes": nbytes, "ranks": world.size, "op": name, "times_s": t.tolist(),
             "median_s": float(np.median(t)), "min_s": float(t.min()), "max_s": float(t.max()),
             "gbps": nbytes / float(np.median(t)) / 1e9} for name, t in zip(names, times)]
    for row in rows:  # x raw: time of the raw sequential op of the same direction over this op's
        ref = next(r for r in rows if r["op"] == ("raw write" if row["op"] in WRITES else "raw read"))
        row["x_raw"] = ref["median_s"] / row["median_s"]
    return rows, wrong


def table(rows) -> str:
    lines = ["| state | bytes | ranks | op | median s | min s | max s | GB/s | x raw |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {human(r['size'])} | {r['bytes']} | {r['ranks']} | {r['op']} | {r['median_s']:.3f} | "
              f"{r['min_s']:.3f} | {r['max_s']:.3f} | {r['gbps']:.2f} | {r['x_raw']:.2f} |" for r in rows]
    verdicts = [f"{human(r['size'])} {r['x_raw']:.3f}x {'yes' if r['x_raw'] >= TARGET else 'NO'}"
                for r in rows if r["op"] == "save"]
    return "\n".join(lines + ["", f"target save >= {TARGET}x raw write: " + ", ".join(verdicts)])


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, REPO)
    from hpctrain.runtime import limit_threads_per_rank

    limit_threads_per_rank()  # before numpy: one thread pool per core, not per rank
    import numpy as np

    from hpctrain.ckpt.format import list_checkpoints
    from hpctrain.errors import UserError
    from hpctrain.runtime import init_world

    world = init_world()
    from mpi4py import MPI

    args.dir, error = os.path.abspath(args.dir), ""
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.repeats >= 1 else []
    except (ValueError, IndexError):
        sizes = []
    if not sizes:
        error = f"--sizes {args.sizes!r} --repeats {args.repeats}: expected sizes like 64M,256M,1G and repeats >= 1"
    elif world.is_root:
        try:
            os.makedirs(args.dir, exist_ok=True)
            if list_checkpoints(args.dir):  # ours is ckpt-00000001.h5: never overwrite a real one
                error = f"--dir {args.dir} holds checkpoints; choose an empty or new directory"
        except OSError as exc:
            error = f"--dir {args.dir} cannot be made ({exc}); choose a writable directory"
    error = world.comm.bcast(error)
    if error:  # the same verdict on every rank: print once, exit non-zero everywhere
        if world.is_root:
            print(f"checkpoint.py: error: {error}", file=sys.stderr)
        return 2

    info = machine(np, world, MPI, args.dir, not args.keep_cache)
    rows, wrong, t_start = [], {}, time.time()
    try:
        for size in sizes:
            new, wrong[human(size)] = measure(np, world, MPI, size, args, info)
            rows += new
            if world.is_root:
                print(f"  {human(size)} done ({time.time() - t_start:.0f} s)", file=sys.stderr, flush=True)
    except UserError as exc:  # write_checkpoint and load_checkpoint raise it on every rank alike
        if world.is_root:
            print(f"checkpoint.py: error: {exc}", file=sys.stderr)
        return 2
    finally:  # what this benchmark wrote, also after a failure; the directory if that empties it
        for path in (os.path.join(args.dir, n) for n in ("raw.bin", "ckpt-00000001.h5", ".ckpt-00000001.h5.tmp")):
            if world.is_root and os.path.exists(path):
                os.remove(path)
        if world.is_root and not os.listdir(args.dir):
            os.rmdir(args.dir)
    if world.is_root:
        print(machine_line(info))
        print(table(rows))
        print("validation: #wrong arrays read back in the warm-up: " + ", ".join(f"{k} {v}" for k, v in wrong.items()))
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args), "machine": info,
                       "wrong": wrong, "rows": rows}, fh, indent=1)
        print(f"json: {args.json}")
        if any(wrong.values()):
            print("checkpoint.py: FAIL: a state read back differs from the saved one (validation)", file=sys.stderr)
    return 1 if any(wrong.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m hpctrain ckpt ls DIR | verify FILE... | inspect FILE``: serial, no MPI needed."""

from __future__ import annotations

import os

from .format import list_checkpoints
from .read import CorruptCheckpoint, inspect_file, verify_file


def _size(n: int) -> str:
    for unit, f in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n} B"


def cmd_ls(args) -> int:
    """One line per committed checkpoint, newest first; ``--verify`` reads and checks each."""
    found = list_checkpoints(args.dir)
    if not found:
        print(f"{args.dir}: no checkpoints (ckpt-<step>.h5)")
        return 0
    bad = 0
    print(f"{'step':>10}  {'ranks':>5}  {'size':>9}  {'created':<24}  {'status':<8}  file")
    for step, path in found:
        try:
            attrs, _ = inspect_file(path)
            status = "ok" if attrs.get("complete") else "INCOMPLETE"
            if args.verify:
                verify_file(path)
                status = "verified"
            ranks, created = attrs.get("world_size", "?"), attrs.get("created", "?")
        except CorruptCheckpoint as exc:
            status, ranks, created, bad = "CORRUPT", "?", "?", bad + 1
            print(f"  ! {exc}")
        print(f"{step:>10}  {ranks!s:>5}  {_size(os.path.getsize(path)):>9}  {created!s:<24}  {status:<8}  "
              f"{os.path.basename(path)}")
    return 1 if bad else 0


def cmd_verify(args) -> int:
    """Read every dataset of each file and compare checksums. Exit 0 all valid, 1 otherwise."""
    bad = 0
    for path in args.files:
        try:
            attrs = verify_file(path)
            print(f"{path}: OK (step {attrs['step']}, saved by {attrs['world_size']} rank(s))")
        except CorruptCheckpoint as exc:
            print(f"{path}: INVALID: {exc}")
            bad += 1
    return 1 if bad else 0


def cmd_inspect(args) -> int:
    """Header, the stored config, and every dataset with shape, dtype, bytes and checksum (no data read)."""
    try:
        attrs, rows = inspect_file(args.file)
    except CorruptCheckpoint as exc:
        print(f"{args.file}: INVALID: {exc}")
        return 1
    config = attrs.pop("config", "")
    print(f"{args.file}")
    for key in sorted(attrs):
        print(f"  {key} = {attrs[key]}")
    print(f"  datasets ({len(rows)}, {_size(sum(r[3] for r in rows))}):")
    for name, shape, dtype, nbytes, crc, per_rank in rows:
        crc_text = f"{crc:#010x}" if crc is not None else "none"
        print(f"    {name:<32} {str(shape):<16} {dtype:<8} {_size(nbytes):>9}  crc32 {crc_text}"
              f"{'  (per rank)' if per_rank else ''}")
    if config:
        print("  config:")
        print("\n".join("    " + line for line in config.splitlines()))
    return 0

"""``python -m hpctrain ckpt ls DIR | verify FILE... | inspect FILE``: serial, no MPI needed.

Every file is read in a child process (:func:`.isolated.run_isolated`): HDF5 may crash or loop on a
corrupt file, and these commands exist to look at files that may be corrupt."""

from __future__ import annotations

import os

from .format import list_checkpoints
from .isolated import run_isolated


def _why(path: str, exc: Exception) -> str:
    """The error's text on one line, without the file name the line already starts with."""
    text = " ".join(str(exc).split("\n"))
    return text[len(path) + 2:] if text.startswith(f"{path}: ") else text


def _size(n: int) -> str:
    for unit, f in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n} B"


def cmd_ls(args) -> int:
    """One line per committed checkpoint, newest first: its header checked (``ok``), or with
    ``--verify`` every byte against its checksum (``verified``); ``CORRUPT`` otherwise."""
    found = list_checkpoints(args.dir)
    if not found:
        print(f"{args.dir}: no checkpoints (ckpt-<step>.h5)")
        return 0
    bad = 0
    print(f"{'step':>10}  {'ranks':>5}  {'size':>9}  {'created':<24}  {'status':<8}  file")
    for step, path in found:
        try:
            attrs = run_isolated("verify_file" if args.verify else "header_of", path)
            status = "verified" if args.verify else "ok"
            ranks, created = attrs.get("world_size", "?"), attrs.get("created", "?")
        except Exception as exc:  # noqa: BLE001 - one bad file must not stop the listing
            status, ranks, created, bad = "CORRUPT", "?", "?", bad + 1
            print(f"  ! {os.path.basename(path)}: {_why(path, exc)}")
        try:
            size = _size(os.path.getsize(path))
        except OSError:
            size = "gone"  # pruned while we listed
        print(f"{step:>10}  {ranks!s:>5}  {size:>9}  {created!s:<24}  {status:<8}  {os.path.basename(path)}")
    return 1 if bad else 0


def cmd_verify(args) -> int:
    """Read every dataset of each file and compare checksums. Exit 0 all valid, 1 otherwise."""
    bad = 0
    for path in args.files:
        try:
            attrs = run_isolated("verify_file", path)
            print(f"{path}: OK (step {attrs['step']}, saved by {attrs['world_size']} rank(s))")
        except Exception as exc:  # noqa: BLE001 - UserErrors name the problem; anything else too
            print(f"{path}: INVALID: {_why(path, exc)}")
            bad += 1
    return 1 if bad else 0


def cmd_inspect(args) -> int:
    """Header, the stored config, and every dataset with shape, dtype, bytes and checksum (no data read)."""
    try:
        attrs, rows = run_isolated("inspect_file", args.file)
    except Exception as exc:  # noqa: BLE001
        print(f"{args.file}: INVALID: {_why(args.file, exc)}")
        return 1
    config = str(attrs.pop("config", ""))
    print(f"{args.file}")
    for key in sorted(attrs):
        print(f"  {key} = {attrs[key]}")
    print(f"  datasets ({len(rows)}, {_size(sum(r[3] for r in rows))}):")
    for name, shape, dtype, nbytes, crc, per_rank in rows:
        crc_text = f"{crc:#010x}" if crc is not None else "none"
        print(f"    {name:<32} {str(tuple(shape)):<16} {dtype:<8} {_size(nbytes):>9}  crc32 {crc_text}"
              f"{'  (per rank)' if per_rank else ''}")
    if config:
        print("  config:")
        print("\n".join("    " + line for line in config.splitlines()))
    return 0

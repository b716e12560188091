"""``python -m hpctrain data ...``: make, import and inspect datasets (no MPI needed)."""

from __future__ import annotations


def add_data_parser(sub) -> None:
    """The ``data`` command and its actions, added to the top-level subparsers ``sub``."""
    d = sub.add_parser("data", help="make or inspect datasets")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="action")
    s = dsub.add_parser("synth", help="write a learnable synthetic classification set (teacher network)")
    s.add_argument("--out", required=True, help="HDF5 file to write (atomically)")
    s.add_argument("--n", type=int, default=65536, help="samples (default 65536)")
    s.add_argument("--dim", type=int, default=32, help="features (default 32)")
    s.add_argument("--classes", type=int, default=10, help="classes (default 10)")
    s.add_argument("--seed", type=int, default=1, help="seed of the samples (default 1)")
    s.add_argument("--teacher-seed", type=int, default=0,
                   help="seed of the labelling teacher; keep it equal for train and eval files (default 0)")
    s.set_defaults(func=cmd_synth)
    di = dsub.add_parser("info", help="check a dataset file and print its shape and classes")
    di.add_argument("path")
    di.set_defaults(func=cmd_info)


def cmd_synth(args) -> int:
    from .synth import write_synthetic

    attrs = write_synthetic(args.out, args.n, args.dim, args.classes, args.seed, args.teacher_seed)
    counts = attrs["class_counts"]
    print(f"wrote {args.out}: {args.n} x {args.dim} float32, {args.classes} classes "
          f"(largest class {counts.max() / counts.sum():.1%} of samples), seed {args.seed}, "
          f"teacher seed {args.teacher_seed}")
    return 0


def cmd_info(args) -> int:
    from .tabular import open_dataset

    ds = open_dataset(args.path, "path")
    print(f"{args.path}: {ds.n} samples x {ds.dim} features ({ds.x.dtype}), {ds.n_classes} classes")
    for key, value in ds.file.attrs.items():
        print(f"  {key} = {value}")
    ds.close()
    return 0

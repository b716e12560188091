"""``python -m hpctrain data ...``: make, import and inspect datasets (no MPI needed)."""

from __future__ import annotations


def add_data_parser(sub) -> None:
    """The ``data`` command and its actions, added to the top-level subparsers ``sub``."""
    d = sub.add_parser("data", help="make, import or inspect datasets")
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
    t = dsub.add_parser("text", help="write a byte-level token file (train/val split) from text files",
                        description="Documents are files; a document is in /val iff a hash of its relative "
                                    "path says so. With no PATHS: the Python standard library's *.py files "
                                    "(without site-packages).")
    t.add_argument("paths", nargs="*", metavar="PATH",
                   help="files (always included) or directories (walked recursively); none = the stdlib")
    t.add_argument("--out", required=True, help="HDF5 token file to write (atomically)")
    t.add_argument("--glob", default=None, metavar="PATTERN",
                   help="files to take from directories, matched against the file name ('/' in it: the "
                        "relative path); default '*.py' for the stdlib, '*' for directories given")
    t.add_argument("--val-percent", type=float, default=2.0, metavar="P",
                   help="percent of documents (by path hash) held out in /val (default 2)")
    t.set_defaults(func=cmd_text)
    im = dsub.add_parser("import", help="write NumPy arrays x (N, D) and y (N,) as a classification file")
    im.add_argument("--x", default="", metavar="X.npy", help="features, one row per sample (numeric)")
    im.add_argument("--y", default="", metavar="Y.npy", help="0-based integer class labels")
    im.add_argument("--npz", default="", metavar="F.npz", help="instead of --x/--y: one archive with arrays x, y")
    im.add_argument("--out", required=True, help="HDF5 file to write (atomically, after the reader's checks)")
    im.add_argument("--classes", type=int, default=0, metavar="C", help="number of classes (default max(y) + 1)")
    im.set_defaults(func=cmd_import)
    di = dsub.add_parser("info", help="check a dataset or token file and print its sizes")
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


def cmd_text(args) -> int:
    import time

    from .text import write_token_file

    start = time.perf_counter()
    a = write_token_file(args.out, args.paths, args.glob, args.val_percent)
    print(f"wrote {args.out}: train {a['n_docs_train']} docs {a['bytes_train']:,} bytes, val {a['n_docs_val']} "
          f"docs {a['bytes_val']:,} bytes; val bits/byte: bigram {a['bigram_bpb']:.3f}, unigram "
          f"{a['unigram_bpb']:.3f} ({a['source']}, {time.perf_counter() - start:.1f} s)")
    return 0


def cmd_import(args) -> int:
    from .importer import import_arrays, load_arrays

    x, y, source = load_arrays(args.x, args.y, args.npz)
    a = import_arrays(args.out, x, y, args.classes, source)
    note = f" (x {x.shape} flattened per row)" if x.ndim > 2 else ""
    print(f"wrote {args.out}: {len(x)} x {a['n_features']} float32, {a['n_classes']} classes{note}, "
          f"from {source}")
    return 0


def cmd_info(args) -> int:
    from .tabular import open_dataset
    from .tokens import FORMAT_NAME, open_tokens

    if _format(args.path) == FORMAT_NAME:
        data = open_tokens(args.path, "path")
        a = data.attrs
        print(f"{args.path}: token file, vocab {data.vocab_size} ({a.get('tokenizer', '?')}), "
              f"train {len(data.train):,} tokens in {a.get('n_docs_train', '?')} docs, "
              f"val {len(data.val):,} tokens in {a.get('n_docs_val', '?')} docs")
        if "bigram_bpb" in a and "unigram_bpb" in a:
            print(f"  val bits/byte baselines: bigram {a['bigram_bpb']:.3f}, unigram {a['unigram_bpb']:.3f}")
        for key, value in a.items():
            print(f"  {key} = {value}")
        data.close()
        return 0
    ds = open_dataset(args.path, "path")
    print(f"{args.path}: {ds.n} samples x {ds.dim} features ({ds.x.dtype}), {ds.n_classes} classes")
    for key, value in ds.file.attrs.items():
        print(f"  {key} = {value}")
    ds.close()
    return 0


def _format(path: str):
    """The root attribute ``format`` of an HDF5 file, or None (the readers then say what is wrong)."""
    import h5py

    from .tokens import file_format

    try:
        with h5py.File(path, "r") as f:
            return file_format(f.attrs)
    except (OSError, ValueError):
        return None

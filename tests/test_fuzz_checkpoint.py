"""Property-based fuzz of checkpoint reading (hypothesis; serial), and corrupt files through the CLI.

Property, for any corruption of a real checkpoint (bits flipped, bytes zeroed or
replaced, truncated, extended, emptied): ``verify_file``, ``load_checkpoint``,
``header_of`` and ``inspect_file`` succeed or raise a UserError, and the load
raises only CorruptCheckpoint (the one error ``--resume auto`` skips past);
verify and load agree; when they succeed, every array (name, dtype, shape,
bytes) and the root attributes a resume uses equal the original's. Never a
crash, never a hang.

How: the readers run as in production, so HDF5 decodes each file in a child process
(:mod:`hpctrain.ckpt.isolated`; the load hands the arrays back through shared memory,
:mod:`hpctrain.ckpt.share`); those children crash or loop on some files. The readers' caller is
itself a worker process here, so that a crash or hang of the caller (what the property forbids)
fails the test instead of killing pytest. The worker runs the four readers side by side (each still
in its own child). A child's cost was its start-up, not its decoding (``python -c`` importing numpy
and h5py: ~0.4 s of CPU, 400 of them most of the test's 103 s in CI), so the worker's children are
forked from a fork server that has made those imports (tests/forked_children.py): each runs the
exec'd child's own code (``sys.exit(main(op, path, *args))``, same argv) with its stdout, stderr and
passed file descriptors where the exec'd child has them, and :func:`run_isolated` around it
(timeout, a crash read from the exit status, the answer from stdout) is unchanged. The fixture checks that the
two kinds of child answer alike on a pristine file, a CRC failure and a file that crashes HDF5 (all
100 examples did, outcome and message, when this was introduced); the CLI and resume tests below
read corrupt files through exec'd children. A child stuck on a loop is given
30 s instead of a minute: side by side on a 2-core machine with a dozen other busy processes a
healthy exec'd child took up to 12 s (none of the 100 examples loops today; the four readers'
timeouts overlap when one does).
"""

import collections
import json
import os
import selectors
import subprocess
import sys

import h5py
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, run_mpi

WORKER = r"""
import hashlib, json, os, sys, types
from concurrent.futures import ThreadPoolExecutor

# the answers leave on a copy of stdout; fd 1, which the fork server and its children inherit, goes
# nowhere: no child writes into the answers, and a crash of this worker still ends them (EOF)
answers = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
sys.path.insert(0, "tests")
import forked_children
forked_children.start()  # before MPI and this worker's threads exist

import numpy as np
from mpi4py import MPI
from hpctrain.ckpt import isolated, read
from hpctrain.errors import UserError
isolated.TIMEOUT_S = 30  # a loop is stopped sooner than in production, a healthy child never (<= 12 s seen)
world = types.SimpleNamespace(comm=MPI.COMM_SELF, rank=0, size=1)
USED = ("format", "format_version", "complete", "step", "world_size", "compress", "compress_scope", "optimizer", "dtype")
SPAWN = {"fork": forked_children.forked_run, "exec": isolated.exec_child}  # exec: production's own children

def digest(c):
    h = hashlib.sha256()
    arrays = {**c.full, **{"own " + k: v for k, v in c.own_rows.items()}}
    for name, a in sorted(arrays.items()):
        h.update(f"{name} {a.dtype.str} {a.shape}".encode() + np.ascontiguousarray(a).tobytes())
    return h.update(repr([(k, c.attrs.get(k)) for k in USED]).encode()) or h.hexdigest()

def outcome(fn):
    try:
        return ["ok", fn()]
    except UserError as e:
        return [type(e).__name__, str(e)]
    except BaseException as e:
        return ["BUG", f"{type(e).__name__}: {e}"]

pool = ThreadPoolExecutor(3)
for line in sys.stdin:
    how, p = line.rstrip("\n").split(" ", 1)
    isolated.spawn_child = SPAWN[how]
    # side by side, each reader in its own child as in production; the load (MPI) stays on the main thread
    others = {"verify": pool.submit(outcome, lambda: read.verify_file(p)["step"]),
              "header": pool.submit(outcome, lambda: read.header_of(p)["step"]),
              "inspect": pool.submit(outcome, lambda: len(read.inspect_file(p)[1]))}
    load = outcome(lambda: digest(read.load_checkpoint(p, world)))
    print(json.dumps({"verify": others["verify"].result(), "load": load, "header": others["header"].result(),
                      "inspect": others["inspect"].result()}), file=answers, flush=True)
"""


def _limit_memory():
    """Corrupt sizes in HDF5 metadata can make the unprotected worker allocate ~12 GB (seen): cap its
    heap (RLIMIT_DATA) so it fails like a crash would, instead of pushing CI's 24 GB machine to swap."""
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))


class Worker:
    """The readers in a child process: ask(path) -> their outcomes, "crash" or "hang"."""

    def __init__(self):
        self.proc = None

    def ask(self, path, timeout=60, how="fork"):  # a healthy answer takes well under a second; looping children 30 s
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=REPO, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                         preexec_fn=_limit_memory)
        self.proc.stdin.write(f"{how} {path}\n")  # how: "fork" (forked_run's children) or "exec"
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout) else None
        if line:
            return json.loads(line)
        verdict = "hang" if line is None else f"crash (exit {self.proc.wait()})"
        self.close()
        return verdict

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _train(data, ckpt_dir, steps, ranks=1, *extra):
    args = ["-m", "hpctrain", "train", "--config", "examples/mlp.toml", "--set", f"data.train={data}",
            "--set", "data.eval=", "--set", "train.metrics=", "--set", "model.hidden=[8]", "--set",
            "train.global_batch=64", "--set", "train.target_accuracy=0", "--set", f"train.steps={steps}",
            "--set", "optim.name=adamw", "--set", f"checkpoint.dir={ckpt_dir}", "--set", "checkpoint.every_steps=2",
            "--set", "checkpoint.keep_last=0", *extra]
    proc = run_mpi(ranks, args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def ckpt(small_data, tmp_path_factory):
    """A pristine 1-rank checkpoint: (path, bytes, (offset, size) of each array's bytes, the worker's
    answer for it, the worker)."""
    folder = tmp_path_factory.mktemp("fuzz-ckpt")
    _train(small_data[0], folder / "ck", 4)
    path = str(folder / "ck" / "ckpt-00000004.h5")
    with h5py.File(path, "r") as f:  # where the arrays' bytes lie: the rest is HDF5 metadata
        spans = []
        f.visititems(lambda n, o: spans.append((o.id.get_offset(), o.id.get_storage_size()))
                     if isinstance(o, h5py.Dataset) else None)
    worker = Worker()
    original = worker.ask(path)
    assert all(r[0] == "ok" for r in original.values()), original
    data = open(path, "rb").read()
    # forked children answer as exec'd ones: a healthy file, a CRC failure, HDF5 crashing in the child
    for name, corruption in {"pristine": ("flip", []), "data-bit": ("flip", [(spans[0][0] + 3, 0x10)]),
                             "hdf5-crash": ("flip", [(data.find(b"FALSE") - 6, 0xFF)])}.items():
        target = str(folder / f"{name}.h5")
        with open(target, "wb") as fh:
            fh.write(damage(data, *corruption))
        forked, execd = worker.ask(target), worker.ask(target, how="exec")
        assert forked == execd, (name, forked, execd)
        assert name != "hdf5-crash" or "HDF5 crashed" in forked["load"][1], forked
    yield path, data, spans, original, worker
    worker.close()


@st.composite
def corruptions(draw, size, spans):
    """(kind, args): where the damage goes is biased toward the superblock and root group at the
    start, the end (root attributes, heaps), the arrays' bytes and the metadata between them."""
    def offset():
        region = draw(st.sampled_from(["head", "tail", "data", "anywhere"]))
        if region == "data":
            start, n = draw(st.sampled_from(spans))
            return start + draw(st.integers(0, n - 1))
        lo, hi = {"head": (0, 512), "tail": (size - 1024, size - 1), "anywhere": (0, size - 1)}[region]
        return draw(st.integers(max(0, lo), hi))
    kind = draw(st.sampled_from(["flip", "flip", "flip", "zero", "insert", "truncate", "append", "random", "empty"]))
    if kind == "flip":
        return kind, [(offset(), draw(st.integers(1, 255))) for _ in range(draw(st.integers(1, 3)))]
    if kind in ("zero", "insert"):
        return kind, (offset(), draw(st.integers(1, 256)))
    if kind == "truncate":
        return kind, draw(st.integers(0, size - 1))
    if kind in ("append", "random"):
        return kind, draw(st.binary(min_size=1, max_size=2048))
    return kind, None


def damage(data: bytes, kind, args) -> bytes:
    b = bytearray(data)
    if kind == "flip":
        for at, mask in args:
            b[at] ^= mask
    elif kind == "zero":
        b[args[0]:args[0] + args[1]] = bytes(min(args[1], len(b) - args[0]))
    elif kind == "insert":
        b[args[0]:args[0]] = bytes(range(args[1]))
    elif kind == "truncate":
        del b[args:]
    elif kind == "append":
        b += args
    elif kind == "random":
        b = bytearray(b"\x89HDF\r\n\x1a\n" + args if args[0] & 1 else args)  # half keep the signature
    else:
        b = bytearray()
    return bytes(b)


SCALE = float(os.environ.get("HPCTRAIN_FUZZ_SCALE", "1"))  # e.g. 20 for a long soak; CI runs 1
FUZZ = settings(max_examples=int(100 * SCALE), deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.mark.timeout(int(400 * SCALE))
def test_random_corruption_is_refused_or_harmless(ckpt, tmp_path):
    path, data, spans, original, worker = ckpt
    target = str(tmp_path / "ckpt-00000004.h5")
    seen = collections.Counter()

    @FUZZ
    @given(corruption=corruptions(len(data), spans))
    def check(corruption):
        with open(target, "wb") as fh:
            fh.write(damage(data, *corruption))
        got = worker.ask(target)
        assert not isinstance(got, str), (got, corruption)  # the readers' caller crashed or hung
        for op, (kind, text) in got.items():
            assert kind != "BUG", (op, text, corruption)
            assert kind == "ok" or "\n" not in text, (op, text)  # one line
        assert got["load"][0] in ("ok", "CorruptCheckpoint"), (got["load"], corruption)
        assert (got["verify"][0] == "ok") == (got["load"][0] == "ok"), (got, corruption)
        if got["load"][0] == "ok":  # harmless (slack, unused metadata): then nothing that is read changed
            assert got["load"] == original["load"] and got["verify"] == original["verify"], corruption
        how = "loaded unchanged" if got["load"][0] == "ok" else "refused"
        if "HDF5 crashed" in got["load"][1] or "did not finish" in got["load"][1]:
            how += " (HDF5 crashed or looped in the child)"
        seen[f"{corruption[0]}: {how}"] += 1

    check()
    print(dict(sorted(seen.items())))  # the observed outcomes per corruption class (pytest -s)
    assert any("unchanged" in k for k in seen) and any("refused" in k for k in seen), seen  # not vacuous


def _first_message_type(path, dataset) -> int:
    """Offset of the first header message's type in ``dataset``'s (version 1) object header."""
    with h5py.File(path, "r") as f:
        return h5py.h5o.get_info(f[dataset].id).addr + 16


def _corrupt_at(path, offset, mask=0xFF):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ mask]))


@pytest.mark.timeout(120)
def test_corrupt_files_through_the_cli_are_one_invalid_line(ckpt, tmp_path):
    path, data, spans, _, _ = ckpt
    cases = {
        "data-bit": ("flip", [(spans[0][0] + 3, 0x10)]),          # a bit of an array: its CRC fails
        "hdf5-crash": ("flip", [(data.find(b"FALSE") - 6, 0xFF)]),  # the per_rank flag's enum type: SIGSEGV in HDF5
        "truncated": ("truncate", len(data) // 2),
        "superblock": ("zero", (0, 64)),
        "empty": ("empty", None),
        "garbage": ("random", b"\x01" + bytes(range(256)) * 8),
    }
    files = []
    for name, (kind, args) in cases.items():
        files.append(str(tmp_path / f"{name}.h5"))
        with open(files[-1], "wb") as fh:
            fh.write(damage(data, kind, args))
    files.append(str(tmp_path / "dataset-as-datatype.h5"))  # /model/fc0/weight loses its dataspace message
    with open(files[-1], "wb") as fh:
        fh.write(data)
    _corrupt_at(files[-1], _first_message_type(files[-1], "/model/fc0/weight"))
    for f in files:
        proc = subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", "verify", f], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stdout.count("\n") == 1, (f, proc.stdout, proc.stderr)
        assert proc.stdout.startswith(f"{f}: INVALID: "), proc.stdout
        assert "corrupt" in proc.stdout or "cannot be opened as HDF5" in proc.stdout, proc.stdout
        assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
        print(proc.stdout.strip())  # the observed message, for the closing note (pytest -s)
    ok = subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", "verify", path], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and "OK (step 4" in ok.stdout, ok.stdout


@pytest.mark.timeout(240)
def test_resume_auto_skips_newest_checkpoints_that_crash_hdf5_or_lost_a_dataset(small_data, tmp_path):
    """Under mpirun -n 2: step 6 lost /model/fc0/weight (a header turned it into a named datatype),
    step 4 crashes HDF5 when read; --resume auto must skip both and resume from step 2."""
    ck = tmp_path / "ck"
    _train(small_data[0], ck, 6, 2)
    newest, middle = str(ck / "ckpt-00000006.h5"), str(ck / "ckpt-00000004.h5")
    _corrupt_at(newest, _first_message_type(newest, "/model/fc0/weight"))
    _corrupt_at(middle, open(middle, "rb").read().find(b"FALSE") - 6)
    proc = _train(small_data[0], ck, 8, 2, "--resume", "auto")
    assert f"skipping {newest}" in proc.stdout and f"skipping {middle}" in proc.stdout, proc.stdout
    assert f"resumed from {ck}/ckpt-00000002.h5 at step 2" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr

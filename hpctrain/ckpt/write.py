"""Writing a checkpoint: every rank writes what it owns in parallel, then an atomic commit.

Protocol (collective over ``world.comm``; docs/checkpoint-format.md, "Saving"):
  1. rank 0 makes the directory; every rank opens ``.ckpt-<step>.h5.tmp`` with h5py's ``mpio``
     driver and creates every dataset (HDF5's metadata calls are collective);
  2. each rank writes its boxes of every entry that has ``pieces`` (owner-writes, :mod:`.ownership`:
     everything a training run saves but its per-rank rows), its rows of any other replicated
     array and its own row of every per-rank one (:mod:`.slices`), or sends those rows to its
     node's writer rank (:mod:`.aggregate`);
  3. each rank checksums what it wrote as it goes; the ranks agree that every write succeeded, XOR
     their CRC contributions (:mod:`.crc`: one all-reduce of one integer per dataset), set them as
     attributes, close the file, and one rank per node fsyncs it;
  4. the ranks agree on the outcome: rank 0 renames the file to ``ckpt-<step>.h5`` and fsyncs the
     directory, or deletes it, and every rank raises the same :class:`CheckpointWriteError`.
Every stage with collective calls starts only after the ranks agreed on the one before, so one
rank's exception never leaves the others waiting; a crash leaves only a dot-file. Without an
MPI-enabled h5py rank 0 writes the file alone (rows gathered to it), with one warning. Test hooks
enter through ``hooks`` (:class:`~hpctrain.reliability.faults.Faults`): ``before_commit(step)``
after the data writes, ``before_close(step)`` before the collective close.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .. import __version__
from ..errors import UserError
from .crc import finish
from .format import FORMAT_NAME, FORMAT_VERSION, GROUPS, attrs_crc32, crc32_of, file_name, temp_name
from .slices import checksums as _checksums  # a module global: tests replace it
from .aggregate import write_data
from .slices import fsync


# datasets of at least this many bytes start on a multiple of it in the file (file-system stripes and
# blocks; smaller ones pack together)
ALIGN_BYTES = 1 << 20


class CheckpointWriteError(UserError):
    """A save that failed (disk full, directory not writable); the previous checkpoints stay valid."""


def mpi_hdf5() -> bool:
    """True when h5py was built against parallel HDF5 (driver="mpio" exists)."""
    import h5py

    return bool(h5py.get_config().mpi)


def write_checkpoint(directory: str, step: int, entries, attrs: dict, world, log=None,
                     collective: bool = False, writers_per_node: int = 0, hooks=None) -> str:
    """Write ``entries`` (see :mod:`.state`) as checkpoint ``step`` in ``directory``; returns its path.

    ``attrs``: extra root attributes (epoch, config text, ...), identical on
    every rank. ``collective``: MPI-IO collective transfers for the data
    writes (default independent: each rank's slices are large and contiguous).
    ``writers_per_node`` k > 0: k ranks per node write the data (:mod:`.aggregate`).
    ``hooks``: the tests' fault hooks (see the module docstring), or None.
    Collective over ``world.comm``; raises :class:`CheckpointWriteError` on
    every rank if any rank failed.
    """
    comm, rank, size = world.comm, world.rank, world.size
    tmp, final = os.path.join(directory, temp_name(step)), os.path.join(directory, file_name(step))
    parallel = mpi_hdf5()
    if not parallel and log is not None:
        log.warn("h5py lacks MPI support (parallel HDF5): rank 0 writes the checkpoint alone; "
                 "rebuild h5py against the MPI in use (scripts/setup.sh) for parallel writes")
    err = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            err = exc
    err = _agree(comm, err)
    # every rank must write identical attribute values: rank 0's clock for all
    attrs = dict(attrs, created=comm.bcast(time.strftime("%Y-%m-%dT%H:%M:%S%z") if rank == 0 else None, root=0))
    if err is None:  # an agreed error is the same object text on every rank: agree once per stage
        write = _write_parallel if parallel else _write_serial
        err = _agree(comm, write(tmp, step, entries, attrs, world, collective, writers_per_node,
                                  hooks or _NO_HOOKS))
        if err is None:
            if rank == 0:
                try:
                    os.replace(tmp, final)
                except OSError as exc:
                    err = exc
                else:
                    try:
                        fsync(directory)
                    except OSError as exc:  # committed; only the rename's durability is in doubt
                        if log is not None:
                            log.warn(f"fsync of {directory!r} after committing {final} failed: {exc}")
            err = _agree(comm, err)
    if err is not None:
        if rank == 0:
            _remove_quietly(tmp)
        failure = CheckpointWriteError(f"saving checkpoint step {step} to {directory!r} failed ({err})"
                                       f"{_space_note(directory, entries, size)}; the previous checkpoints are "
                                       f"intact; free space or choose another checkpoint.dir")
        failure.agreed = True  # raised on every rank alike
        raise failure
    return final


def _space_note(directory, entries, size) -> str:
    """For the error message: the file system's free space, and whether the checkpoint fits in it
    (HDF5 reports a full disk only as "file write failed")."""
    try:
        st = os.statvfs(directory)
        need = sum(int(np.prod(e.shape[1:] if e.per_rank else e.shape)) * (size if e.per_rank else 1)
                   * np.dtype(e.dtype).itemsize for e in entries)
    except Exception:  # noqa: BLE001 - only a hint; never hide the failure itself
        return ""
    free = st.f_bavail * st.f_frsize
    mib = 1 << 20
    if free < need:
        return f"; the disk is full: {free / mib:.1f} MiB free, the checkpoint needs {need / mib:.1f} MiB"
    return f" ({free / mib:.1f} MiB free on its file system)"


def _root_attrs(step, attrs, size):
    out = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step, "world_size": size,
           "hpctrain_version": __version__}
    out.update(attrs)
    out["attrs_crc32"] = np.uint32(attrs_crc32(out))
    return out


def _plan(step, entries, attrs, size):
    """Everything the file will hold except the data: [(path, shape, dtype, per_rank)] and root attributes.

    Pure Python, computed before any HDF5 call, so a failure here can be agreed
    on before the collective dataset creation (which communicates inside HDF5)."""
    layout = [(e.path, (size,) + tuple(e.shape[1:]) if e.per_rank else tuple(e.shape), np.dtype(e.dtype),
               bool(e.per_rank)) for e in entries]
    return layout, _root_attrs(step, attrs, size)


def _create(f, plan):
    """Groups, datasets and root attributes of ``plan``: only HDF5 calls, the same on every rank."""
    layout, root = plan
    for group in GROUPS:
        f.require_group(group)
    dsets = []
    for path, shape, dtype, per_rank in layout:
        d = f.create_dataset(path, shape=shape, dtype=dtype)
        d.attrs["per_rank"] = per_rank
        dsets.append(d)
    for key, value in root.items():
        f.attrs[key] = value
    return dsets


def _write_parallel(tmp, step, entries, attrs, world, collective, writers_per_node, hooks):
    """The parallel write; returns an error agreed by every rank, or None.

    Every stage that makes collective calls (open, dataset creation, attributes,
    close) is entered by all ranks or by none: the outcome of the stage before
    is agreed first, so an exception on one rank never leaves the others
    waiting in a collective.
    """
    import h5py

    comm, size = world.comm, world.size
    f = err = plan = None
    try:
        plan = _plan(step, entries, attrs, size)
    except Exception as exc:  # noqa: BLE001
        err = exc
    err = _agree(comm, err)
    if err is not None:
        return err
    try:
        f = h5py.File(tmp, "w", driver="mpio", comm=comm, alignment_threshold=ALIGN_BYTES,
                      alignment_interval=ALIGN_BYTES)
    except Exception as exc:  # noqa: BLE001
        err = exc
    err = _agree(comm, err)
    if err is not None:
        return err  # a handle open on some ranks only is left to the process exit: closing it is collective
    dsets = None
    try:
        # HDF5 calls only: parallel HDF5 communicates inside them, so an error raised
        # by HDF5 on one rank alone cannot be recovered here (the watchdog's case)
        dsets = _create(f, plan)
    except Exception as exc:  # noqa: BLE001
        err = exc
    err = _agree(comm, err)
    mine = np.zeros(len(entries), np.uint32)
    if err is None:
        contributions, err = write_data(tmp, entries, dsets, world, collective, writers_per_node)
        if err is None:
            try:
                mine = _checksums(contributions)
                hooks.before_commit(step)
            except Exception as exc:  # noqa: BLE001
                err = exc
        everyone = comm.allgather(None if err is None else _text(err))
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if failed:
            err = _agreed_error(failed[0][1] if size == 1 else f"rank {failed[0][0]}: {failed[0][1]}")
        else:  # every rank's contributions XORed: one integer per dataset crosses (crc.py)
            from mpi4py import MPI

            total = np.zeros_like(mine)
            comm.Allreduce(mine, total, op=MPI.BXOR)
            try:
                for i, d in enumerate(dsets):
                    nbytes = int(np.prod(d.shape, dtype=np.int64)) * d.dtype.itemsize
                    d.attrs["crc32"] = np.uint32(finish(int(total[i]), nbytes))
                f.attrs["complete"] = True
            except Exception as exc:  # noqa: BLE001
                err = exc
        hooks.before_close(step)
    try:
        f.close()
    except Exception as exc:  # noqa: BLE001
        err = err or exc
        LEFT_OPEN.append(f)  # see files_left_open
    if err is None and getattr(world, "local_rank", 0) == 0:
        # the only flush: MPI_File_close need not sync (ROMIO and ompio do not), and
        # HDF5 lets every rank write metadata at close; one rank per node fsyncs (a
        # node's ranks share its page cache or file-system client, so one covers them)
        try:
            fsync(tmp)
        except OSError as exc:
            err = exc
    return err


LEFT_OPEN: list = []  # h5py files whose close failed (a full disk while HDF5 flushed its metadata)


def files_left_open() -> bool:
    """True when a failed save left a file that HDF5 could not close.

    HDF5 keeps such a file open; Python would close it again during its final
    garbage collection, after mpi4py's MPI_Finalize, and the mpio driver then
    crashes the process (SIGSEGV: exit 139 instead of the agreed error's 2;
    seen with a full disk). The command line therefore ends such a process
    with ``os._exit`` and no MPI_Finalize (hpctrain.__main__); the temporary
    file itself was already deleted by rank 0.
    """
    return bool(LEFT_OPEN)


def _text(exc) -> str:
    return getattr(exc, "agreed_text", None) or f"{type(exc).__name__}: {exc}"


def _agreed_error(text):
    err = RuntimeError(text)
    err.agreed_text = text
    return err


def _write_serial(tmp, step, entries, attrs, world, collective, writers_per_node, hooks):
    """Without parallel HDF5: every rank's per-rank rows and owned boxes are gathered to rank 0,
    which writes the file alone (the degraded path, warned about by the caller)."""
    import h5py

    comm, rank, size = world.comm, world.rank, world.size
    try:
        own = [e.rows(rank, rank + 1) for e in entries if e.per_rank]
        boxes = [[(start, count, np.asarray(get(0, count[0]))) for start, count, get in e.pieces]
                 for e in entries if e.pieces is not None]
        own = (own, boxes)
    except Exception as exc:  # noqa: BLE001 - still take part in the gather
        own = _text(exc)
    gathered = comm.gather(own, root=0)
    if rank != 0:
        return None
    failed = [(r, g) for r, g in enumerate(gathered) if isinstance(g, str)]
    if failed:
        return _agreed_error(f"rank {failed[0][0]}: {failed[0][1]}" if size > 1 else failed[0][1])
    try:
        with h5py.File(tmp, "w") as f:
            dsets = _create(f, _plan(step, entries, attrs, size))
            per_rank, owned = iter(range(len(gathered[0][0]))), iter(range(len(gathered[0][1])))
            for e, d in zip(entries, dsets):
                if e.per_rank:
                    k = next(per_rank)
                    full = np.concatenate([np.asarray(g[0][k], dtype=e.dtype) for g in gathered])
                elif e.pieces is not None:
                    k, full = next(owned), np.zeros(d.shape, e.dtype)
                    for g in gathered:
                        for start, count, block in g[1][k]:
                            full[tuple(slice(a, a + c) for a, c in zip(start, count))] = block
                else:
                    full = np.ascontiguousarray(e.rows(0, d.shape[0]), dtype=e.dtype)
                d[...] = full
                d.attrs["crc32"] = np.uint32(crc32_of(full))
            hooks.before_commit(step)
            f.attrs["complete"] = True
        fsync(tmp)
    except Exception as exc:  # noqa: BLE001 - agreed on by the caller
        return exc
    return None


def _agree(comm, err):
    """The first failing rank's error (as text, naming the rank), or None when every rank
    succeeded. Collective. An error that is already agreed passes through unchanged."""
    errors = comm.allgather(None if err is None else (getattr(err, "agreed_text", None), _text(err)))
    for r, e in enumerate(errors):
        if e is not None:
            agreed, text = e
            return _agreed_error(agreed or (text if comm.Get_size() == 1 else f"rank {r}: {text}"))
    return None


class _NoHooks:
    """No test hooks (a save outside the tests)."""

    def before_commit(self, step):
        pass

    def before_close(self, step):
        pass


_NO_HOOKS = _NoHooks()


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass

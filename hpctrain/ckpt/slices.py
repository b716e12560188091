"""A rank's share of a checkpoint's data: its boxes, MPI-IO transfers, checksums, writeback, fsync.

Used by :mod:`.write` between the collective creation of the datasets and
the agreement on the outcome.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from .crc import box_contribution
from .format import row_range

# HDF5 1.10's MPI-IO driver passes a transfer's size as a C int: a slice over
# 2 GiB fails ("can't convert from size to size_i"), so slices go in pieces
PIECE_BYTES = 1 << 30



def own_pieces(e, d, rank: int, size: int) -> list:
    """What this rank writes of entry ``e`` into dataset ``d``: [(start, count, get)], boxes of at
    most PIECE_BYTES (cut along their first axis), ``get()`` making the box's host array. An entry
    with ``pieces`` (owner-writes, :mod:`.ownership`) gives its boxes; one without gives the rank's
    rows (:func:`~.format.row_range`, or its own row of a per-rank array)."""
    if e.pieces is not None:
        boxes = [(tuple(start), tuple(count), get) for start, count, get in e.pieces]
    else:
        lo, hi = (rank, rank + 1) if e.per_rank else row_range(d.shape[0], rank, size)
        tail = tuple(d.shape[1:])
        boxes = [((lo,) + (0,) * len(tail), (hi - lo,) + tail,
                  lambda a, b, lo=lo: e.rows(lo + a, lo + b))] if hi > lo else []
    out = []
    for start, count, get in boxes:
        row_bytes = max(1, d.dtype.itemsize * int(np.prod(count[1:], dtype=np.int64)))
        per = max(1, PIECE_BYTES // row_bytes)
        for a in range(0, count[0], per):
            b = min(count[0], a + per)
            out.append(((start[0] + a,) + start[1:], (b - a,) + count[1:], functools.partial(get, a, b)))
    return out


def write_slices(entries, dsets, rank, size, collective, writeback_fd=None, calls=None):
    """This rank's boxes of every dataset (:func:`own_pieces`), each written, then checksummed.

    Returns (contributions, error): ``contributions[i]`` is the XOR of the CRC contributions
    (:mod:`.crc`) of what this rank wrote to dataset i, computed as each box is written so a box's
    host copy lives only while it is written. A failure stops this rank's writes but, with
    ``collective``, not its calls: every rank makes ``calls[i]`` transfer calls for dataset i (the
    most any rank makes, :func:`call_counts`; empty ones after a failure), or the others would hang.
    ``writeback_fd``: see :func:`start_writeback`, called after each box.
    """
    if collective and calls is None:
        raise ValueError("collective transfers need every dataset's call count (call_counts)")
    contributions, err = [], None
    for i, (e, d) in enumerate(zip(entries, dsets)):
        acc, err = write_entry(e, d, rank, size, collective, calls[i] if calls is not None else 0, writeback_fd, err)
        contributions.append(acc)
    return contributions, err


def write_entry(e, d, rank, size, collective, calls, writeback_fd, err):
    """:func:`write_slices` for one dataset: (its contribution, the error so far)."""
    pieces = own_pieces(e, d, rank, size)
    acc = 0
    for k in range(max(len(pieces), calls) if collective else len(pieces)):
        called = False
        try:
            if err is None and k < len(pieces):
                start, count, get = pieces[k]
                block = np.ascontiguousarray(get(), dtype=e.dtype).reshape(count)
                called = True
                write_box(d, start, block, collective)
                start_writeback(writeback_fd)
                acc ^= box_contribution(block, start, count, d.shape)
        except Exception as exc:  # noqa: BLE001 - keep taking part in the collectives
            err = exc
        if collective and not called:
            write_box(d, None, None, True)
    return acc, err


def call_counts(entries, dsets, world) -> list[int]:
    """For collective transfers: the most boxes any rank writes to each dataset (collective over
    ``world.comm``: one MPI_MAX all-reduce of one integer per dataset)."""
    from mpi4py import MPI

    mine = np.array([len(own_pieces(e, d, world.rank, world.size)) for e, d in zip(entries, dsets)], np.int64)
    most = np.zeros_like(mine)
    world.comm.Allreduce(mine, most, op=MPI.MAX)
    return [int(n) for n in most]


def checksums(contributions) -> np.ndarray:
    """This rank's CRC contributions of every dataset as one uint32 array (XOR-reduced over the
    ranks by :mod:`.write`, then finished with :func:`~.crc.finish`)."""
    return np.array([int(c) & 0xFFFFFFFF for c in contributions], np.uint32)


def write_box(dset, start, block, collective):
    """``block`` into the box of ``dset`` at ``start``; with ``collective`` every rank must call, an
    empty selection (``start`` None) included."""
    if not collective:
        if block is not None and block.size:
            dset[tuple(slice(s, s + c) for s, c in zip(start, block.shape))] = block
        return
    from h5py import h5fd, h5p, h5s

    dxpl = h5p.create(h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)
    fspace = dset.id.get_space()
    if block is not None and block.size:
        fspace.select_hyperslab(tuple(start), block.shape)
        mspace = h5s.create_simple(block.shape)
    else:  # h5py skips empty selections, and a rank that skips a collective transfer hangs the others
        fspace.select_none()
        mspace = h5s.create_simple((1,))
        mspace.select_none()
        block = np.zeros(1, dset.dtype)
    dset.id.write(mspace, fspace, block, dxpl=dxpl)


def write_rows(dset, lo, hi, block, collective):
    """Rows [lo, hi) of ``dset`` (:func:`write_box` of whole rows; the aggregated writes use it)."""
    write_box(dset, (lo,) + (0,) * (len(dset.shape) - 1) if hi > lo else None, block if hi > lo else None,
              collective)


def _sync_file_range():
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range  # Linux (glibc, musl)
    except (ImportError, OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it


def start_writeback(fd):
    """Have the kernel start writing the file's dirty pages to disk now, without waiting.

    Called after each data write: the disk then writes a dataset while the
    next one is copied into the page cache, and the single fsync after the
    close waits only for what is left (64 MB by one process here: 41-44 ms
    instead of 50-60 for write then fsync). Only a hint: a failure is
    ignored (the fsync decides), and without ``sync_file_range`` (not Linux)
    or ``fd`` (None) it does nothing.
    """
    if fd is not None and _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def fsync(path):
    """fsync a file or a directory (for a rename's durability) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

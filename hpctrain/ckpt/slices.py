"""A rank's share of a checkpoint's data: row pieces, MPI-IO transfers, checksums, writeback, fsync.

Used by :mod:`.write` between the collective creation of the datasets and
the agreement on the outcome.
"""

from __future__ import annotations

import os

import numpy as np

from .format import combine_parts, crc32_of, row_range

# HDF5 1.10's MPI-IO driver passes a transfer's size as a C int: a slice over
# 2 GiB fails ("can't convert from size to size_i"), so slices go in pieces
PIECE_BYTES = 1 << 30



def write_slices(entries, dsets, rank, size, collective, writeback_fd=None):
    """This rank's rows of every dataset, in pieces of at most PIECE_BYTES.

    Returns (blocks, error): ``blocks[i]`` is the list of host arrays written
    for dataset i (their CRCs are computed later, while the disk syncs). A
    failure stops this rank's writes but, with ``collective``, not its calls:
    every rank makes the same number of transfer calls per dataset (empty ones
    after a failure), or the others would hang. ``writeback_fd``: see
    :func:`start_writeback`, called after each piece.
    """
    blocks, err = [], None
    for e, d in zip(entries, dsets):
        lo, hi = (rank, rank + 1) if e.per_rank else row_range(d.shape[0], rank, size)
        row_bytes = max(1, d.dtype.itemsize * int(np.prod(d.shape[1:])))
        per = max(1, PIECE_BYTES // row_bytes)
        pieces = [(a, min(a + per, hi)) for a in range(lo, hi, per)]
        most = 1 if e.per_rank else row_range(d.shape[0], 0, size)[1]  # rank 0 has the most rows
        calls = max(len(pieces), -(-most // per)) if collective else len(pieces)
        written = []
        for i in range(calls):
            called = False
            try:
                if err is None and i < len(pieces):
                    a, b = pieces[i]
                    block = np.ascontiguousarray(e.rows(a, b), dtype=e.dtype)
                    called = True
                    write_rows(d, a, b, block, collective)
                    start_writeback(writeback_fd)
                    written.append(block)
            except Exception as exc:  # noqa: BLE001 - keep taking part in the collectives
                err = exc
            if collective and not called:
                write_rows(d, 0, 0, None, True)
        blocks.append(written)
    return blocks, err


def checksums(blocks):
    """(crc, bytes) of each dataset's blocks (this rank's share).

    Computed after the writes and before the single fsync (after the close):
    with ISA-L's CRC (~28 GB/s, :mod:`.format`) it costs ~2 ms per 64 MB. An
    earlier design hid zlib's slower CRC (~4 GB/s) behind an extra fsync of
    the data before the close; that second flush cost more than it hid once
    the CRC got fast (64 MB at 1 rank: 0.75x of the raw write with it).
    """
    return [(combine_parts([(crc32_of(b), b.nbytes) for b in written]), sum(b.nbytes for b in written))
            for written in blocks]


def write_rows(dset, lo, hi, block, collective):
    """Rows [lo, hi) of ``dset``; with ``collective`` every rank must call, an empty range included."""
    if not collective:
        if hi > lo:
            dset[lo:hi] = block  # h5py's mpio default: an independent transfer
        return
    from h5py import h5fd, h5p, h5s

    dxpl = h5p.create(h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)
    fspace = dset.id.get_space()
    if hi > lo:
        fspace.select_hyperslab((lo,) + (0,) * (len(dset.shape) - 1), block.shape)
        mspace = h5s.create_simple(block.shape)
    else:
        # h5py's high-level API skips empty selections, and a rank that skips a
        # collective transfer hangs the others: select nothing explicitly
        fspace.select_none()
        mspace = h5s.create_simple((1,))
        mspace.select_none()
        block = np.zeros(1, dset.dtype)
    dset.id.write(mspace, fspace, block, dxpl=dxpl)


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

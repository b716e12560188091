"""A dataset's CRC-32 from disjoint boxes written by many ranks, with one XOR all-reduce.

zlib's CRC-32 is affine over GF(2): ``crc(M) = lin(M) ^ crc(0 * len(M))``, where ``lin`` is the bare
register (zero start, no final inversion), linear in the message bits. A dataset's message M (its
bytes in C order) is the XOR of messages that each hold one rank's boxes and zeros elsewhere, so
``lin(M)`` is the XOR of each box's *contribution*: ``lin`` of the box's bytes laid out at their
place in the message. A box's contribution is computed from its own bytes alone (a run of bytes
at offset o moves to its place by multiplying ``lin(run)`` by x^(8 (len(M) - o - len(run))) mod P,
zlib's ``crc32_combine(c, 0, n)``), so a rank XORs its boxes' contributions locally and the ranks
XOR theirs with one MPI_BXOR all-reduce of one uint32 per dataset: O(datasets) per rank, any world
size, any boxes, as long as they tile the dataset (an element covered twice cancels, and the
verification of the file then fails: never silently).

Shifts go through zlib's C ``crc32_combine_gen``/``crc32_combine_op`` (zlib >= 1.2.12) via ctypes,
else :func:`~.format.crc32_combine` (pure Python, ~100 x slower; the same values).
"""

from __future__ import annotations

import functools

import numpy as np

from .format import _crc32, crc32_combine

MASK = 0xFFFFFFFF


def _zlib():
    try:
        import ctypes

        lib = ctypes.CDLL("libz.so.1")
        gen, op = lib.crc32_combine_gen64, lib.crc32_combine_op
    except (OSError, AttributeError):
        return None
    gen.argtypes, gen.restype = [ctypes.c_int64], ctypes.c_ulong
    op.argtypes, op.restype = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong], ctypes.c_ulong
    return gen, op


_ZLIB = _zlib()


@functools.lru_cache(maxsize=4096)
def _operator(n: int):
    """zlib's operator for ``n`` zero bytes (an int), or None without zlib's C functions."""
    return None if _ZLIB is None else _ZLIB[0](n)


def shift(value: int, n: int) -> int:
    """``value`` (a CRC register) advanced over ``n`` zero bytes: x^(8n) * value mod P."""
    if n <= 0 or not value:
        return value
    op = _operator(n)
    if op is None:
        return crc32_combine(value, 0, n)
    return _ZLIB[1](value, 0, op) & MASK


def linear(data) -> int:
    """``lin`` of a buffer's bytes (zero start, no final inversion)."""
    return (_crc32(data, MASK) ^ MASK) & MASK


def zeros_crc(n: int) -> int:
    """zlib.crc32 of ``n`` zero bytes."""
    return (shift(MASK, n) ^ MASK) & MASK


def finish(lin_total: int, nbytes: int) -> int:
    """The dataset's zlib CRC-32 from the XOR of every box's contribution."""
    return (lin_total ^ zeros_crc(nbytes)) & MASK


def _runs(start, count, shape):
    """The box ``start``/``count`` of a C-order array of ``shape`` as runs of consecutive elements:
    (first element index, elements per run, index step between runs, number of runs) per block of
    the leading axes' iteration, yielded in ascending order."""
    nd = len(shape)
    if nd == 0:
        yield 0, 1, 0, 1
        return
    # the trailing axes the box covers whole merge into its run; the one before them bounds the run
    k = nd - 1
    while k > 0 and start[k] == 0 and count[k] == shape[k]:
        k -= 1
    inner = int(np.prod(shape[k + 1:], dtype=np.int64)) if k + 1 < nd else 1
    run = count[k] * inner
    stride_k = inner
    # the runs along axis k-1 (if any) step by the row length of axis k; the axes before are iterated
    if k == 0:
        yield start[0] * stride_k, run, 0, 1
        return
    row = shape[k] * inner
    lead = [range(start[a], start[a] + count[a]) for a in range(k - 1)]
    strides = [int(np.prod(shape[a + 1:], dtype=np.int64)) for a in range(nd)]
    for idx in np.ndindex(*[len(r) for r in lead]) if lead else [()]:
        base = sum((lead[a][i]) * strides[a] for a, i in enumerate(idx))
        first = base + start[k - 1] * strides[k - 1] + start[k] * stride_k
        yield first, run, row, count[k - 1]


def box_contribution(block: np.ndarray, start, count, shape) -> int:
    """The contribution of ``block`` (the box at ``start`` of size ``count`` of a dataset of
    ``shape``, the block's elements in C order) to the dataset's ``lin``."""
    block = np.ascontiguousarray(block)
    if block.dtype.byteorder == ">":
        block = block.astype(block.dtype.newbyteorder("<"))
    size = block.itemsize
    data = block.reshape(-1).view(np.uint8)
    total = int(np.prod(shape, dtype=np.int64)) * size
    if data.size == 0:
        return 0
    acc, end, at = 0, None, 0
    for first, run, step, n in _runs(tuple(int(s) for s in start), tuple(int(c) for c in count), tuple(shape)):
        nbytes = run * size
        for j in range(n):
            offset = (first + j * step) * size
            piece = linear(data[at:at + nbytes])
            at += nbytes
            acc = piece if end is None else shift(acc, offset - end + nbytes) ^ piece
            end = offset + nbytes
    return shift(acc, total - end)

"""Where a rank's part of a flat buffer lies in the checkpoint's logical arrays.

A rank holds parameters and optimizer state as flat buffers of *local* parameter slots (a tensor
rank's pieces, a pipeline stage's layers), whole or as ZeRO chunks (ranges of the flat buffer).
:func:`range_boxes` turns a range of flat elements into *boxes*: hyperslabs of the logical arrays
(HDF5 selections: a start and a count per axis), each with the flat range that holds it and how its
elements sit in that range. Pure arithmetic, no MPI, no data: the save writes the boxes it owns
(:mod:`.ownership`), the load reads the boxes it needs.

A split parameter (``split`` = (axis, parts), :mod:`hpctrain.nn.tensor_parallel`): along ``axis``
the logical array is ``parts`` equal blocks, each cut in t pieces, and tensor rank r holds piece r of
every block; so a local run along that axis is contiguous in the logical array until a piece ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Box:
    """A hyperslab ``start``/``count`` of the logical array ``path``, held by flat elements [lo, hi)
    of a rank's buffer: those elements reshaped to ``block`` and sliced by ``cols`` (a column range
    of a 2-D block, or None: all of it) are the box's elements in C order. ``owned``: this rank
    writes the box (save) or checksums it (load). ``whole``: the logical array's shape."""

    path: str
    start: tuple
    count: tuple
    lo: int
    hi: int
    block: tuple
    cols: tuple | None = None
    owned: bool = True
    whole: tuple = ()

    @property
    def size(self) -> int:
        return int(np.prod(self.count, dtype=np.int64))

    def rows_range(self, a: int, b: int) -> tuple[int, int]:
        """The flat elements holding the box's rows [a, b) along its first axis (of its block)."""
        width = int(np.prod(self.block[1:], dtype=np.int64)) if len(self.block) > 1 else 1
        return self.lo + a * width, self.lo + b * width


def _runs_along(lo: int, hi: int, piece: int | None):
    """[lo, hi) cut where a tensor piece of ``piece`` elements ends (None: not split)."""
    if piece is None:
        yield lo, hi
        return
    a = lo
    while a < hi:
        b = min(hi, (a // piece + 1) * piece)
        yield a, b
        a = b


def _to_logical(i: int, piece: int | None, t: int, r: int) -> int:
    """A local index along the split axis -> the logical index (identity when not split)."""
    if piece is None:
        return i
    return (i // piece) * piece * t + r * piece + i % piece


def slot_boxes(path: str, shape: tuple, offset: int, lo: int, hi: int, split=None, t: int = 1, r: int = 0,
               owned: bool = True) -> list[Box]:
    """The boxes of the logical array ``path`` held by flat elements [lo, hi) of a local slot of
    ``shape`` starting at flat element ``offset`` (lo and hi are flat indices inside the slot).
    ``split``: (axis, parts) of a tensor-split slot (this is rank ``r`` of ``t``'s piece), or None."""
    shape = tuple(int(n) for n in shape)
    if len(shape) > 2:
        raise NotImplementedError(f"{path}: checkpoints of parameters of more than 2 axes ({shape})")
    axis, parts = split if split is not None else (None, 1)
    piece = shape[axis] // parts if axis is not None else None
    whole = tuple(n * t if i == axis else n for i, n in enumerate(shape))
    out = []
    a, b = lo - offset, hi - offset
    if len(shape) <= 1:
        for x, y in _runs_along(a, b, piece if axis == 0 else None):
            g = _to_logical(x, piece if axis == 0 else None, t, r)
            out.append(Box(path, (g,), (y - x,), offset + x, offset + y, (y - x,), None, owned, whole))
        return out
    rows, width = shape
    # [a, b) as a partial first row, whole rows, a partial last row: each a contiguous local block
    blocks = []
    if a % width and a < b:
        end = min(b, (a // width + 1) * width)
        blocks.append((a // width, 1, a % width, end - a))
        a = end
    if b - a >= width:
        n = (b - a) // width
        blocks.append((a // width, n, 0, width))
        a += n * width
    if a < b:
        blocks.append((a // width, 1, 0, b - a))
    for row, nrows, col, ncols in blocks:
        flat_lo = offset + row * width + col
        flat_hi = flat_lo + nrows * ncols
        block = (nrows, ncols)
        if axis == 0:
            for x, y in _runs_along(row, row + nrows, piece):
                g = _to_logical(x, piece, t, r)
                sub_lo = flat_lo + (x - row) * ncols
                out.append(Box(path, (g, col), (y - x, ncols), sub_lo, sub_lo + (y - x) * ncols, (y - x, ncols),
                               None, owned, whole))
        elif axis == 1:
            for x, y in _runs_along(col, col + ncols, piece):
                g = _to_logical(x, piece, t, r)
                cols = None if (x, y) == (col, col + ncols) else (x - col, y - col)
                out.append(Box(path, (row, g), (nrows, y - x), flat_lo, flat_hi, block, cols, owned, whole))
        else:
            out.append(Box(path, (row, col), (nrows, ncols), flat_lo, flat_hi, block, None, owned, whole))
    return out


def range_boxes(slots, lo: int, hi: int, path_of, split_of=lambda name: None, t: int = 1, r: int = 0,
                owned_slot=lambda name: True, owned: bool = True) -> list[Box]:
    """The boxes held by flat elements [lo, hi) of a buffer laid out by ``slots`` (objects with
    ``name``, ``offset``, ``size``, ``shape``, sorted by offset). ``path_of(name)``: the slot's dataset;
    ``split_of(name)``: its (axis, parts) or None; ``owned_slot(name)``: whether this rank writes that
    slot's boxes (replicas across tensor ranks or pipeline stages: one writer), and'ed with ``owned``."""
    out = []
    for s in slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.size)
        if a < b:
            out += slot_boxes(path_of(s.name), s.shape, s.offset, a, b, split_of(s.name), t, r,
                              owned and owned_slot(s.name))
    return out


def box_from_block(box: Box, block: np.ndarray) -> np.ndarray:
    """The box's elements (its ``count`` shape) from the flat elements [lo, hi) as ``block``."""
    block = np.asarray(block).reshape(box.block)
    if box.cols is not None:
        block = block[:, box.cols[0]:box.cols[1]]
    return block.reshape(box.count)

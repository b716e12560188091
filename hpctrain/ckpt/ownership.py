"""Who writes which part of a checkpoint, and which parts a rank reads back: a plan, like the buckets.

A rank holds each flat buffer (the parameters, each optimizer state) whole or as its ZeRO chunks,
over its local slots (its tensor pieces, its pipeline stage). :func:`buffer_shares` says, per
buffer, the flat ranges the rank *holds* (what a load must give it) and the ranges it *owns* (what
it writes at a save, and checksums at a load), so that the owners of every element of every logical
array are exactly one rank:

  * a ZeRO chunk is owned by the rank that holds it (it is the only one);
  * a buffer held whole by every rank of the data group is cut into ``d`` ranges of at least
    :data:`MIN_PIECE_BYTES` (fewer ranges when it is smaller), range k owned by data rank
    (k + the rank's place in the tensor x pipeline grid) mod d, so small models' bytes spread over
    the grid's data ranks instead of all landing on data rank 0;
  * a parameter replicated over the tensor group (not split) is written by tensor rank
    (its slot index mod t); one held by several pipeline stages (the tied table) by the first.

:mod:`.boxes` turns the ranges into hyperslabs of the logical arrays. No tensor data moves between
ranks to save or load; the only messages are the stages' slot names (pipeline) and the replicas' CRCs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .boxes import Box, box_from_block, range_boxes
from .format import parameter_path

# a replicated buffer is cut into pieces of at least this many bytes, one writer each (tests lower it)
MIN_PIECE_BYTES = 4 << 20
CRC_CHUNK_BYTES = 64 << 20   # the replicas' CRC is taken this much at a time (host memory bound)


@dataclass
class BufferShare:
    """One flat buffer of a rank: ``array`` as it holds it (whole, or its ZeRO chunks packed) on
    ``device`` (its ``to_host`` and ``copy_from_host``); ``held`` the flat ranges (lo, hi, at: where
    the range starts in ``array``), ``owned`` the flat ranges (lo, hi) it writes (inside ``held``)."""

    group: str
    array: object
    device: object
    held: list
    owned: list

    def host(self, lo: int, hi: int) -> np.ndarray:
        """Flat elements [lo, hi) (inside one held range) as a host array."""
        return np.asarray(self.device.to_host(self.array[self.where(lo, hi)]))

    def where(self, lo: int, hi: int) -> slice:
        """The slice of ``array`` holding flat elements [lo, hi) (inside one held range)."""
        for a, b, at in self.held:
            if a <= lo and hi <= b:
                return slice(at + lo - a, at + hi - a)
        raise IndexError(f"{self.group}: flat elements [{lo}, {hi}) are not held by this rank")


def spread(n: int, itemsize: int, d: int, rank: int, rotate: int = 0) -> list[tuple[int, int]]:
    """The ranges of a buffer of ``n`` elements that data rank ``rank`` of ``d`` owns (see the module
    docstring): [] or one range."""
    if n == 0:
        return []
    per = max(-(-n // d), -(-MIN_PIECE_BYTES // max(1, itemsize)))
    out = []
    for k in range(-(-n // per)):
        if (k + rotate) % d == rank:
            out.append((k * per, min(n, (k + 1) * per)))
    return out


@dataclass
class SlotMap:
    """How a rank's local slots map to logical arrays: ``slots`` (the model's flat slots), ``split_of``
    a slot's tensor split or None, (``t``, ``r``) the tensor group's size and this rank's place in it,
    ``writes(name)`` whether this rank writes a slot whose replicas other ranks hold too; ``shared``
    the names of this rank's slots that other pipeline stages hold too (the tied table)."""

    slots: list
    split_of: Callable
    t: int
    r: int
    writes: Callable
    shared: frozenset = frozenset()

    def boxes(self, group: str, lo: int, hi: int, owned: bool) -> list[Box]:
        return range_boxes(self.slots, lo, hi, lambda name: parameter_path(group, name), self.split_of,
                           self.t, self.r, self.writes, owned)


def slot_map(model, plan, paper: bool = False) -> SlotMap:
    """The :class:`SlotMap` of ``model`` (this rank's part) in ``plan``'s grid. Collective over the
    pipeline group when p > 1 (the stages' slot names: which stage writes the tied table); with
    ``paper`` (counting bytes, no communication) a later stage's ``wte``, the GPT's tied table, is
    taken as the first stage's."""
    slots = list(model.flat.slots)
    layout = getattr(model, "tensor_layout", None)
    split_of = (lambda name: None) if layout is None else (lambda name: layout.splits.get(name))
    t, r = (1, 0) if layout is None else (layout.group.size, layout.group.rank)
    index = {s.name: i for i, s in enumerate(slots)}
    first, holders = {}, {}
    stage = 0
    if getattr(plan, "pipeline", 1) > 1 and paper:
        stage = plan.grid.stage
        if stage > 0 and "wte" in index:
            first["wte"], holders["wte"] = 0, 2
    elif getattr(plan, "pipeline", 1) > 1:
        stage, comm = plan.grid.stage, plan.grid.pipeline.comm
        for k, names in enumerate(comm.allgather([s.name for s in slots])):
            for name in names:
                first.setdefault(name, k)
                holders[name] = holders.get(name, 0) + 1

    def writes(name):
        split = split_of(name) is not None
        return first.get(name, stage) == stage and (split or index[name] % t == r)
    shared = frozenset(s.name for s in slots if holders.get(s.name, 1) > 1)
    return SlotMap(slots, split_of, t, r, writes, shared)


def _grid_place(plan) -> int:
    """This rank's place in the tensor x pipeline grid (its data group's index)."""
    grid = getattr(plan, "grid", None)
    return 0 if grid is None else getattr(grid, "stage", 0) * getattr(grid, "t", 1) + getattr(grid, "tensor_rank", 0)


def buffer_shares(state, plan) -> list[BufferShare]:
    """This rank's :class:`BufferShare` of the parameters (group "model") and of each optimizer
    state (group "optim/<name>"), in that order. Local."""
    dev, flat, opt = plan.device, state.model.flat, state.optimizer
    dp = getattr(plan, "dp", None) or plan.world
    d, rank, rotate, item = dp.size, dp.rank, _grid_place(plan), np.dtype(dev.dtype).itemsize

    def whole(group, array, device):
        return BufferShare(group, array, device, [(0, flat.size, 0)], spread(flat.size, item, d, rank, rotate))

    def chunks(group, array, device, shards):
        held = [(lo, hi, at) for lo, hi, at in shards.pieces if hi > lo]
        return BufferShare(group, array, device, held, [(lo, hi) for lo, hi, _ in held])

    slots = getattr(plan, "param_slots", None)
    out = [chunks("model", slots.owned, dev, slots.shards) if slots is not None else whole("model", flat.data, dev)]
    sdev = getattr(opt, "state_device", dev)   # (dist.offload: the state is in host memory)
    shards = getattr(opt, "shards", None)
    for name, buf in opt.state().items():
        out.append(chunks(f"optim/{name}", buf, sdev, shards) if shards is not None
                   else whole(f"optim/{name}", buf, sdev))
    return out


def fill(share: BufferShare, boxes: list, arrays) -> None:
    """Copy the arrays read for ``boxes`` (share_boxes of ``share``, every held range; ``arrays``
    yields them in order) into ``share``'s buffer, one local block at a time (the boxes of a block
    split by tensor pieces are put together on the host first), cast to the buffer's dtype."""
    from itertools import groupby

    dtype = np.dtype(share.array.dtype)
    for (lo, hi), group in groupby(boxes, key=lambda b: (b.lo, b.hi)):
        group = list(group)
        got = [next(arrays) for _ in group]
        if hi == lo:   # the empty boxes of arrays this rank holds nothing of
            continue
        if len(group) == 1 and group[0].cols is None:
            host = np.asarray(got[0]).reshape(-1)
        else:
            host = np.empty(group[0].block, got[0].dtype)
            for box, array in zip(group, got):
                cols = box.cols or (0, box.block[-1])
                host[..., cols[0]:cols[1]] = np.asarray(array).reshape(box.block[:-1] + (cols[1] - cols[0],))
        share.device.copy_from_host(share.array[share.where(lo, hi)],
                                    np.ascontiguousarray(host.reshape(-1), dtype=dtype))


def share_boxes(share: BufferShare, slots: SlotMap, owned_only: bool) -> list[Box]:
    """The boxes of ``share``: every held range cut at the owned ranges' ends, each box flagged
    ``owned`` (and only the owned ones with ``owned_only``)."""
    out = []
    for lo, hi, _ in share.held:
        cuts = sorted({lo, hi} | {x for a, b in share.owned for x in (a, b) if lo < x < hi})
        for a, b in zip(cuts[:-1], cuts[1:]):
            mine = any(x <= a and b <= y for x, y in share.owned)
            if mine or not owned_only:
                out += [box for box in slots.boxes(share.group, a, b, mine) if box.owned or not owned_only]
    return out


def box_rows(share: BufferShare, box: Box, a: int, b: int) -> np.ndarray:
    """Rows [a, b) (along the first axis) of ``box``'s elements, from ``share``'s buffer, on the host."""
    lo, hi = box.rows_range(a, b)
    part = Box(box.path, box.start, (b - a,) + tuple(box.count[1:]), lo, hi, (b - a,) + tuple(box.block[1:]),
               box.cols, box.owned, box.whole)
    return box_from_block(part, share.host(lo, hi))


def replica_crcs(share: BufferShare, slots: SlotMap, names: list[str]) -> list[int]:
    """CRC-32 of this rank's held elements of each slot ``names`` (in order), read from the buffer
    :data:`CRC_CHUNK_BYTES` at a time: what the replicas compare."""
    from .format import _crc32

    by_name = {s.name: s for s in slots.slots}
    item = np.dtype(getattr(share.array, "dtype", np.float32)).itemsize
    step = max(1, CRC_CHUNK_BYTES // item)
    out = []
    for name in names:
        s, crc = by_name[name], 0
        for lo, hi, _ in share.held:
            a, b = max(lo, s.offset), min(hi, s.offset + s.size)
            for x in range(a, b, step):
                crc = _crc32(np.ascontiguousarray(share.host(x, min(b, x + step))).view(np.uint8), crc)
        out.append(crc & 0xFFFFFFFF)
    return out


def logical_arrays(model) -> list[tuple[str, tuple]]:
    """(name, logical shape) of every parameter of the whole model (every stage, unsplit), in the
    order of a one-rank run's flat buffer."""
    if hasattr(model, "logical_params"):
        return [(name, tuple(shape)) for name, shape in model.logical_params()]
    logical = getattr(model, "logical_shape", lambda s: s.shape)
    return [(s.name, tuple(logical(s))) for s in model.flat.slots]


def checkpoint_bytes(model, optimizer, plan, async_save: bool = False) -> dict:
    """What a checkpoint takes on this rank, counted from the layout alone (no communication):
    ``file`` the logical arrays' bytes (the whole file, less its small arrays), ``writes`` the
    bytes this rank writes, ``reads`` those a load in this layout reads, ``save_host`` the host
    bytes a save holds beyond the training state (the largest piece it copies at once, or with
    ``async_save`` all it writes, ``kept`` then between saves: the copies are reused) and
    ``load_host`` those a load holds (what it reads, plus the largest block it puts together)."""
    from types import SimpleNamespace

    from .slices import PIECE_BYTES

    shares = buffer_shares(SimpleNamespace(model=model, optimizer=optimizer), plan)
    smap = slot_map(model, plan, paper=True)
    item = np.dtype(plan.device.dtype).itemsize
    writes = reads = largest = block = 0
    for share in shares:
        for box in share_boxes(share, smap, owned_only=False):
            n = box.size * item
            reads += n
            block = max(block, (box.hi - box.lo) * item)
            if box.owned:
                writes += n
                largest = max(largest, min(n, PIECE_BYTES))
    whole = sum(int(np.prod(shape)) for _, shape in logical_arrays(model)) * item * len(shares)
    return {"file": whole, "writes": writes, "reads": reads, "save_host": writes if async_save else largest,
            "kept": async_save, "load_host": reads + block}

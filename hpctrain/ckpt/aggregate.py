"""Write aggregation: a few writer ranks per node write the other local ranks' slices.

As ROMIO's collective buffering does with ``cb_nodes``, for independent writes: a node's local
ranks form ``writers_per_node`` groups of consecutive local ranks; the first of each (its *writer*)
receives the others' row pieces over the node communicator, one at a time into one reused buffer,
and writes them. Every rank still computes the CRC of its own rows, so checksums combine as without
aggregation (:mod:`.write`). Who writes what is a pure function of the topology (all-gathered once
per save) and the datasets' shapes. A member that cannot produce its rows sends one ``TAG_FAILED``
message and nothing after it; a writer whose own write failed still receives (and drops) its
members' pieces; so nobody waits for a message that never comes, and the error is agreed afterwards.
With ``collective`` every rank makes as many transfer calls per dataset as the busiest writer
(members' empty), and a member sends each piece just before the call that writes it.
"""

from __future__ import annotations

import os

import numpy as np

from . import slices
from .crc import box_contribution
from .format import row_range

# A piece sent to a writer: the writer's one receive buffer is at most this big
# (its own rows still go in pieces of slices.PIECE_BYTES, straight from memory)
SEND_BYTES = 64 << 20
TAG_PIECE, TAG_FAILED = 0x4850, 0x4851  # tags on local_comm, unused elsewhere


def writer_map(world, writers_per_node: int) -> tuple[list[int], dict]:
    """(``writer``, ``local_of``): ``writer[r]`` is the world rank that writes rank r's rows (r itself
    for a writer); ``local_of`` maps the world ranks of this node to their rank in ``world.local_comm``.
    Collective over ``world.comm``.

    Local ranks 0..L-1 of a node split into min(writers_per_node, L) blocks of
    consecutive local ranks (block g: the l with l * W // L == g); the lowest
    local rank of a block writes for it. ``writers_per_node`` 0: every rank writes.
    """
    where = getattr(world, "where", ()) or world.comm.allgather((world.node_rank, world.local_rank))
    local_size: dict = {}
    for node, _ in where:
        local_size[node] = local_size.get(node, 0) + 1
    rank_of = {nl: r for r, nl in enumerate(where)}
    writer = []
    for node, local in where:
        n = local_size[node]
        w = min(writers_per_node, n) if writers_per_node > 0 else n
        first = -(-(local * w // n) * n // w)  # the lowest l of this rank's block
        writer.append(rank_of[(node, first)])
    return writer, {r: local for r, (node, local) in enumerate(where) if node == world.node_rank}


def _pieces(d, e, rank, size, piece_bytes):
    """Rank ``rank``'s rows of dataset ``d`` as [(lo, hi)] of at most ``piece_bytes`` each."""
    lo, hi = (rank, rank + 1) if e.per_rank else row_range(d.shape[0], rank, size)
    row_bytes = max(1, d.dtype.itemsize * int(np.prod(d.shape[1:])))
    per = max(1, piece_bytes // row_bytes)
    return [(a, min(a + per, hi)) for a in range(lo, hi, per)]


def _schedule(d, e, w, members, size):
    """What writer ``w`` writes to ``d``, in order: [(rank, lo, hi)], its own pieces first,
    then each member's (rank order), in pieces of at most SEND_BYTES."""
    out = [(w, a, b) for a, b in _pieces(d, e, w, size, slices.PIECE_BYTES)]
    sent = min(slices.PIECE_BYTES, SEND_BYTES)
    for m in members:
        out += [(m, a, b) for a, b in _pieces(d, e, m, size, sent)]
    return out


def write_aggregated(entries, dsets, world, writers, collective, writeback_fd=None, calls=None):
    """This rank's part of the aggregated write; returns (contributions, error) as
    :func:`.slices.write_slices`: ``contributions[i]`` covers this rank's own rows of dataset i
    (written by it or sent to its writer). ``writers``: :func:`writer_map`. An entry with
    ``pieces`` (owner-writes: ZeRO chunks, tensor pieces, a stage's arrays) is written by its
    owners themselves (:func:`.slices.write_entry`; ``calls`` as there): aggregating would move tensor
    data between ranks. Called by every rank of ``world.comm`` between the dataset creation and the
    agreement on the outcome.
    """
    from mpi4py import MPI

    writer, local_of = writers
    rank, size, local = world.rank, world.size, world.local_comm
    groups: dict = {}
    for r, w in enumerate(writer):
        if r != w:
            groups.setdefault(w, []).append(r)
    me_writer, to = writer[rank] == rank, local_of[writer[rank]]
    whose = set(writer) if collective else {writer[rank]}  # collective: every writer's plan sets the calls
    plans = [None if e.pieces is not None else {w: _schedule(d, e, w, groups.get(w, []), size) for w in whose}
             for e, d in zip(entries, dsets)]
    # the writer's one receive buffer, as big as the largest piece it receives
    need = max([(b - a) * d.dtype.itemsize * int(np.prod(d.shape[1:])) for p, d in zip(plans, dsets) if p
                for src, a, b in p[writer[rank]] if src != rank] + [0]) if me_writer else 0
    buf = np.empty(need, np.uint8)
    blocks, err, failed, status = [], None, set(), MPI.Status()
    for k, (e, d, p) in enumerate(zip(entries, dsets, plans)):
        if e.pieces is not None:
            acc, err = slices.write_entry(e, d, rank, size, collective, calls[k] if calls else 0, writeback_fd, err)
            blocks.append(acc)
            continue
        plan = p[writer[rank]]  # a member walks its writer's plan, to send each piece in its turn
        written = 0
        for i in range(max(len(q) for q in p.values())):
            src, a, b = plan[i] if i < len(plan) else (None, 0, 0)
            block = None
            if src == rank and err is None:  # my own rows: write them, or send them to my writer
                try:
                    block = np.ascontiguousarray(e.rows(a, b), dtype=e.dtype)
                    written ^= box_contribution(block, (a,) + (0,) * (block.ndim - 1), block.shape, d.shape)
                except Exception as exc:  # noqa: BLE001 - keep taking part in the messages and collectives
                    err = exc
                    if not me_writer:  # instead of this piece; it sends nothing after it
                        local.Send(np.zeros(0, np.uint8), dest=to, tag=TAG_FAILED)
                if block is not None and not me_writer:
                    local.Send(block.reshape(-1).view(np.uint8), dest=to, tag=TAG_PIECE)
            elif me_writer and src is not None and src != rank and src not in failed:  # a member's rows
                shape = (b - a,) + tuple(d.shape[1:])
                nbytes = int(np.prod(shape)) * d.dtype.itemsize
                local.Recv(buf[:nbytes], source=local_of[src], tag=MPI.ANY_TAG, status=status)
                if status.Get_tag() == TAG_FAILED:
                    failed.add(src)  # it reports its own error; nothing more comes from it
                elif status.Get_count(MPI.BYTE) != nbytes:
                    err = err or RuntimeError(f"aggregated checkpoint write: rank {src} sent "
                                              f"{status.Get_count(MPI.BYTE)} bytes, expected {nbytes}")
                elif err is None:  # after a failure of its own the writer still drains its members
                    block = buf[:nbytes].view(d.dtype).reshape(shape)
            if me_writer and block is not None and err is None:
                try:  # a call made even if it raises (as in slices.write_slices): no empty call after it
                    slices.write_rows(d, a, b, block, collective)
                    slices.start_writeback(writeback_fd)
                except Exception as exc:  # noqa: BLE001 - keep receiving and calling
                    err = exc
            elif collective:
                slices.write_rows(d, 0, 0, None, True)
        blocks.append(written)
    return blocks, err


def write_data(path, entries, dsets, world, collective, writers_per_node):
    """This rank's share of the data writes into the open file ``path``: aggregated when
    ``writers_per_node`` makes some rank write for another, else every rank writes its own rows
    (:func:`.slices.write_slices`); either way the disk starts on each piece as soon as it is
    written (:func:`.slices.start_writeback`). Returns (contributions, error). Collective over
    ``world.comm`` (every rank takes the same branch: ``writer_map`` is the same everywhere)."""
    writers = writer_map(world, writers_per_node) if writers_per_node > 0 and world.size > 1 else None
    calls = slices.call_counts(entries, dsets, world) if collective else None
    try:  # a descriptor of our own on the file HDF5 writes, for the writeback hint only
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        fd = None
    try:
        if writers and any(w != r for r, w in enumerate(writers[0])):  # else it is the plain write
            return write_aggregated(entries, dsets, world, writers, collective, fd, calls)
        return slices.write_slices(entries, dsets, world.rank, world.size, collective, fd, calls)
    finally:
        if fd is not None:
            os.close(fd)

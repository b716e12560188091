"""ZeRO-1 (``dist.zero = 1``): each rank keeps the optimizer state of its share of every bucket.

ZeRO-2 drops the rest of the gradient too (:mod:`.zero_grads`), ZeRO-3 the rest of the parameters
(:mod:`.zero_params`); :func:`plan_zero` builds a stage's shares and slots. Every bucket is cut into
``size`` chunks as the ring cuts a buffer (:func:`~.ring.chunk_offsets`, none padded), and each rank
owns the chunk its strategy's reduce-scatter leaves the sum in (:func:`owned_chunk_rule`). Shares
follow the buckets, not one range of the flat buffer, so every rank takes an equal part in every
bucket's reduce-scatter. A rank's chunks packed (:class:`ZeroShards`) are its optimizer state, about
1/size of zero 0's. Per bucket, each step:

    reduce-scatter the gradient (sum; this rank's chunk, in place)   communication thread
    scale and test this rank's chunk only                             (the ranks' answers are summed)
    the optimizer updates this rank's chunk of the parameters         main thread
    all-gather the bucket's parameters (not under ZeRO-3)             main thread, a duplicate communicator

The all-gathers have a communicator of their own (:func:`param_gatherer`) because the communication
thread reduce-scatters later buckets meanwhile: two threads' collectives on one communicator could
pair up differently on different ranks. Checkpoints stay logical: each rank writes and reads its own
chunks of the logical arrays (:mod:`hpctrain.ckpt.ownership`); :meth:`ZeroShards.gather` builds the
whole state on the host (the tests' reference).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from .ring import chunk_offsets
from .zero_grads import GradientSlots
from .zero_params import ParameterSlots
from .zero_slots import vector_buckets

STAGES = (0, 1, 2, 3)  # 2: the gradients too (hpctrain.comm.zero_grads); 3: the parameters too (.zero_params)


def owned_chunk_rule(allreduce: str, world, inner: str = "mpi"):
    """``owned_chunk(rank, size)`` of strategy ``allreduce`` on ``world``: which chunk its
    reduce-scatter leaves with a rank (ring: rank + 1; hierarchical on nodes of equal size: by
    node and local rank, :func:`~.hierarchical.chunk_rule`; the others: rank). Local."""
    from . import STRATEGIES
    from .halves import WholeSumHalves
    from .hierarchical import chunk_rule

    if allreduce == "hierarchical":
        return chunk_rule(world, inner)
    return STRATEGIES.get(allreduce, WholeSumHalves).owned_chunk


def param_gatherer(allreduce: str, strategy, world, device, staging, inner: str = "mpi"):
    """The strategy whose all-gathers ZeRO's parameter gathers use, built on duplicates of
    ``world``'s communicators (the main thread gathers while the communication thread
    reduce-scatters): another ``allreduce`` where ``strategy`` has halves of its own
    (``native_halves``: mpi, ring, rhd, hierarchical on nodes of one size), else naive, whose
    MPI_Allgatherv is the one all the others use (so no second auto measurement or shared window is
    built for it). Collective."""
    from . import make_allreduce

    name = allreduce if getattr(strategy, "native_halves", False) else "naive"
    dup = dataclasses.replace(world, comm=world.comm.Dup())
    if name == "hierarchical":  # its all-gather runs in the node and across
        dup = dataclasses.replace(dup, local_comm=world.local_comm.Dup(), cross_comm=world.cross_comm.Dup())
    return make_allreduce(name, dup, device, staging, inner=inner)


class ZeroShards:
    """The chunks rank ``rank`` of ``size`` owns of each of ``buckets``.

    ``pieces[i]``: (lo, hi, packed) of bucket i: the flat range owned and where it starts
    in the packed state; ``owned``: the packed state's length.
    """

    def __init__(self, buckets, rank: int, size: int, owned_chunk):
        self.rank, self.size, self.owned_chunk = rank, size, owned_chunk
        self.buckets = list(buckets)
        self.pieces, packed = [], 0
        for b in self.buckets:
            off = chunk_offsets(b.size, size)
            c = owned_chunk(rank, size)
            self.pieces.append((b.lo + off[c], b.lo + off[c + 1], packed))
            packed += off[c + 1] - off[c]
        self.owned = packed
        order = sorted(range(len(self.pieces)), key=lambda i: self.pieces[i][0])
        self._starts = [self.pieces[i][0] for i in order]
        self._sorted = [self.pieces[i] for i in order]

    def packed(self, lo: int, hi: int) -> slice:
        """The packed-state slice of flat elements [lo, hi), which must lie inside one owned chunk."""
        k = bisect.bisect_right(self._starts, lo) - 1
        if k < 0:
            raise IndexError(f"elements [{lo}, {hi}) are not this rank's")
        a, b, at = self._sorted[k]
        if not a <= lo <= hi <= b:
            raise IndexError(f"elements [{lo}, {hi}) are not inside this rank's chunk [{a}, {b})")
        return slice(at + lo - a, at + hi - a)

    def _layout(self, bucket):
        """(counts, displacements) in rank order of ``bucket``'s chunks in the flat buffer."""
        off = chunk_offsets(bucket.size, self.size)
        owned = [self.owned_chunk(r, self.size) for r in range(self.size)]
        return [off[c + 1] - off[c] for c in owned], [bucket.lo + off[c] for c in owned]

    def gather(self, comm, packed_host: np.ndarray, total: int) -> np.ndarray:
        """The whole flat state (``total`` elements) on every rank from each rank's packed
        chunks (``packed_host``, this rank's). Collective over ``comm``."""
        full = np.empty(total, packed_host.dtype)
        for b, (lo, hi, at) in zip(self.buckets, self.pieces):
            counts, displs = self._layout(b)
            comm.Allgatherv(np.ascontiguousarray(packed_host[at:at + hi - lo]), [full, (counts, displs)])
        return full

def plan_zero(stage: int, dist, buckets, model, device, world):
    """(shards, slots, params) of ``dist.zero = stage`` for this rank of ``world``: all None for 0;
    the :class:`ZeroShards` of strategy ``dist.allreduce`` (the ``dist`` config section) for 1;
    for 2 also the :class:`~.zero_grads.GradientSlots`, with ``model``'s gradients moved into them
    (its whole gradient buffer dropped and, on a GPU, freed now); for 3 also the
    :class:`~.zero_params.ParameterSlots` (the model, built without a whole parameter buffer, moves
    onto them at their ``adopt``, with this rank's shares of the initial weights). Local."""
    if not stage:
        return None, None, None
    owned_chunk = owned_chunk_rule(dist.allreduce, world, dist.hierarchical_inner)
    shards = ZeroShards(buckets, world.rank, world.size, owned_chunk)
    if stage == 1:
        return shards, None, None
    resident = ()
    if stage == 3:
        # a layer gathered alone must read only its own parameters, and a GPT block's parts run one
        # at a time (a block stops fusing the next LayerNorm into its output add; else its forward
        # spans two blocks' buckets); the buckets of vectors stay gathered in slots of their own
        getattr(model, "separate_layers", lambda: None)()
        resident = vector_buckets(buckets, model.flat)
    slots = GradientSlots(buckets, shards, model.flat, model.backward_groups, device, resident)
    model.use_grad_buffer(slots.buffer, slots.offsets)
    getattr(device, "release_freed", lambda: None)()
    if stage == 2:
        return shards, slots, None
    forward = list(getattr(model, "forward_groups", []))
    return shards, slots, ParameterSlots(buckets, shards, model.flat, [*forward, *model.backward_groups], device,
                                         overlap=dist.overlap, resident=resident,
                                         orders=(forward, model.backward_groups),
                                         dtype=getattr(model.device, "dtype", None))   # the compute dtype


def traffic_halves(zero: int, native: bool, micro_steps: int) -> int:
    """Per step, the uncompressed traffic per rank in halves of an all-reduce (each (p-1)/p of the
    buckets): an all-reduce is 2; ZeRO's reduce-scatter 1 with halves of the strategy's own
    (``native``), else 2 (the whole all-reduce, :class:`~.halves.WholeSumHalves`), once per
    micro-batch under ZeRO-2 and 3, plus 1 for the all-gather after the update (not under ZeRO-3, whose
    gathers before use the step counts as they run)."""
    if not zero:
        return 2
    scatter = 1 if native else 2
    return scatter * (micro_steps if zero >= 2 else 1) + (zero < 3)


def refusal(zero: int, compress: str) -> str | None:
    """Why ``dist.zero`` cannot run with these settings, or None."""
    if zero and compress != "none":
        return (f"dist.zero={zero} with dist.compress={compress!r} is not supported: the compressors reduce whole "
                f"buckets and keep whole-gradient residuals; use dist.zero=0 to compress, or dist.compress=none")
    return None

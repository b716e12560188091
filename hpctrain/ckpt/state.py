"""What a checkpoint holds: the training state as named logical arrays, and back.

Every array is an :class:`Entry`: a path in the file, its full (logical) shape and dtype, and what
this rank writes of it: the boxes it owns (``pieces``; parameters and optimizer state, by
:mod:`.ownership`), or rows [lo, hi) as a host array. Two kinds:

  * replicated (``per_rank=False``): one logical array however the run holds it (parameters,
    optimizer state, data position); each element written by one rank, read at any layout: each
    rank the boxes it needs (:func:`needed_boxes`), the small arrays whole.
  * per-rank (``per_rank=True``): a leading world dimension, row r rank r's. The RNG at a new world
    size: rank r takes saved row r when r < the saved world size, else a fresh generator
    (:func:`fresh_rng`, seeded from (train.seed, rank, step)); rows of ranks that no longer exist
    are dropped, with a log line. /compress has its own rule (:mod:`.compress_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import UserError
from .compress_state import compression_rows, restore_compression
from .format import OPTIMIZER_STATES, parameter_path
from .boxes import Box
from .ownership import box_rows, buffer_shares, fill, logical_arrays, replica_crcs, share_boxes, slot_map

# /data/position fields, in order (int64)
POSITION_FIELDS = ("global_step", "epoch", "step_in_epoch", "global_batch", "shuffle_seed", "n_samples")
RNG_FIELDS = ("state_hi", "state_lo", "inc_hi", "inc_lo", "has_uint32", "uinteger")  # PCG64, uint64


class IncompatibleCheckpoint(UserError):
    """The checkpoint verifies but does not fit this run (model shapes, optimizer)."""


@dataclass
class Entry:
    path: str                                   # e.g. "/model/fc0/weight"
    shape: tuple
    dtype: np.dtype
    rows: Callable[[int, int], np.ndarray] | None  # host rows [lo, hi); per-rank: called with (rank, rank + 1)
    per_rank: bool = False
    # owner-writes (.ownership): the boxes this rank writes, [(start, count, get)], get(a, b) giving the
    # box's rows [a, b) on the host; every element owned by one rank. None: each rank its row_range rows
    pieces: list | None = None


def _host_entry(path, array, per_rank=False, writer: bool | None = None):
    """An entry over a host array: per-rank (a row per rank), or replicated, written whole by the one
    rank with ``writer`` True (None: every rank its row_range rows)."""
    array = np.asarray(array)
    if per_rank:
        return Entry(path, (None,) + array.shape, array.dtype, lambda lo, hi: array[None], per_rank=True)
    pieces = None if writer is None else [((0,) * array.ndim, array.shape, lambda a, b: array[a:b])] if writer else []
    return Entry(path, array.shape, array.dtype, lambda lo, hi: array[lo:hi], pieces=pieces)


def rng_to_array(rng: np.random.Generator) -> np.ndarray:
    s = rng.bit_generator.state
    if s["bit_generator"] != "PCG64":
        raise TypeError(f"only PCG64 generators are checkpointed, got {s['bit_generator']}")
    st, inc, mask = s["state"]["state"], s["state"]["inc"], (1 << 64) - 1
    return np.array([st >> 64, st & mask, inc >> 64, inc & mask, s["has_uint32"], s["uinteger"]], np.uint64)


def rng_from_array(a) -> np.random.Generator:
    v = [int(x) for x in a]
    gen = np.random.Generator(np.random.PCG64())
    gen.bit_generator.state = {"bit_generator": "PCG64", "state": {"state": (v[0] << 64) | v[1],
                               "inc": (v[2] << 64) | v[3]}, "has_uint32": v[4], "uinteger": v[5]}
    return gen


def fresh_rng(seed: int, rank: int, step: int = 0) -> np.random.Generator:
    """The per-rank generator of a fresh start (step 0) or of a rank that a resharded resume adds."""
    return np.random.default_rng([seed, rank, step])


def _replicas_agree(shares, smap, plan) -> list[str]:
    """The replicated arrays whose copies differ: each parameter a tensor group holds unsplit, and
    each one several pipeline stages hold (the tied table), compared by CRC-32 (collective over the
    tensor and pipeline groups; only CRCs move). Lines for :func:`_check_replicas`."""
    drifted = []
    layout = getattr(plan, "tensor", None)
    if layout is not None and smap.t > 1:
        names = [s.name for s in smap.slots if smap.split_of(s.name) is None]
        comm = layout.world.comm
        for share in shares:
            crcs = comm.allgather(replica_crcs(share, smap, names))
            for k, name in enumerate(names):
                if len({c[k] for c in crcs}) > 1:
                    drifted.append(f"replicated parameter {name!r} differs across the tensor group (CRC32 per "
                                   f"tensor rank: {', '.join(f'{c[k]:08x}' for c in crcs)})")
    if getattr(plan, "pipeline", 1) > 1:
        comm = plan.grid.pipeline.comm
        for share in shares:
            names = sorted(smap.shared)
            held = dict(zip(names, replica_crcs(share, smap, names)))
            stages = comm.allgather(held)
            for name in sorted({n for st in stages for n in st}):
                if len({st[name] for st in stages if name in st}) > 1:
                    drifted.append(f"{parameter_path(share.group, name)}: the pipeline's first and last stage "
                                   f"hold different copies")
    return drifted


def _check_replicas(drifted: list) -> None:
    if drifted:
        raise RuntimeError("tensor or pipeline parallelism kept the replicated arrays apart (not saved: the file "
                           "would hold one rank's copy): " + "; ".join(drifted))


def training_state(state, plan) -> list[Entry]:
    """Every array of ``state`` (a :class:`~hpctrain.training.state.TrainingState`) that a bit-exact
    restart needs, in file order. Parameters and optimizer state are the whole model's logical
    arrays, each rank's entries holding only the boxes it owns of them (:mod:`.ownership`): its ZeRO
    chunks, its tensor pieces, its stage's arrays, its part of what its data group holds alike; no
    array is gathered. Collective over the tensor and pipeline groups (the replicas' CRCs)."""
    dev, sampler, cfg, world = plan.device, state.sampler, plan.cfg, plan.world
    shares = buffer_shares(state, plan)
    smap = slot_map(state.model, plan)
    if smap.t > 1 or getattr(plan, "pipeline", 1) > 1:
        from ..reliability.fail_together import agree

        agree(world, _check_replicas, _replicas_agree(shares, smap, plan))  # one verdict, before any writing
    entries = []
    for share in shares:
        pieces: dict = {}
        for box in share_boxes(share, smap, owned_only=True):
            pieces.setdefault(box.path, []).append(
                (box.start, box.count, lambda a, b, share=share, box=box: box_rows(share, box, a, b)))
        entries += [Entry(parameter_path(share.group, name), shape, np.dtype(dev.dtype), None,
                          pieces=pieces.get(parameter_path(share.group, name), []))
                    for name, shape in logical_arrays(state.model)]
    first = world.rank == 0   # the small replicated arrays: written whole by rank 0
    entries.append(_host_entry("/optim/step_count", np.array([getattr(state.optimizer, "t", 0)], np.int64),
                               writer=first))
    epoch, in_epoch = sampler.position(state.step)
    entries.append(_host_entry("/data/position", np.array(
        [state.step, epoch, in_epoch, cfg.train.global_batch, cfg.data.shuffle_seed, sampler.n], np.int64),
        writer=first))
    entries.append(_host_entry("/rng/pcg64", rng_to_array(state.rng), per_rank=True))
    if getattr(state, "loss_scale", None) is not None:   # fp16: the same on every rank
        entries.append(_host_entry("/precision/loss_scale", np.array(state.loss_scale.state(), np.float64),
                                   writer=first))
    entries += [_host_entry(path, row, per_rank=True) for path, row in compression_rows(state.compression, world)]
    return entries


def snapshot(entries: list[Entry], rank: int, buffers: dict | None = None) -> list[Entry]:
    """``entries`` with every piece and row this rank writes copied aside on the host now (the
    training state may change while a background writer writes them): as many bytes as the rank
    writes, plus its per-rank rows. ``buffers`` (a dict the caller keeps between saves, never while
    a write of the last snapshot may still read them): the copies go into the same host arrays each
    time, so a save after the first copies into memory already mapped (page faults made ~0.7 GB/s
    of a ~5 GB/s copy on first touch)."""
    buffers = {} if buffers is None else buffers

    def copied(key, source):
        source = np.asarray(source)
        buf = buffers.get(key)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            buf = buffers[key] = np.empty(source.shape, source.dtype)
        np.copyto(buf, source)
        return buf

    out = []
    for e in entries:
        if e.pieces is not None:
            pieces = [(start, count, lambda a, b, block=copied((e.path, tuple(start)), get(0, count[0])): block[a:b])
                      for start, count, get in e.pieces]
            out.append(Entry(e.path, e.shape, e.dtype, None, e.per_rank, pieces))
        elif e.per_rank:
            row = copied((e.path, "row"), e.rows(rank, rank + 1))
            out.append(Entry(e.path, e.shape, e.dtype, lambda lo, hi, row=row: row, True))
        else:
            whole = copied((e.path, "whole"), e.rows(0, e.shape[0]))
            out.append(Entry(e.path, e.shape, e.dtype, lambda lo, hi, whole=whole: whole[lo:hi]))
    return out


# optimizers whose saved state means the same (AdamW's moments are LAMB's); SGD's momentum and LARS's
# are both named "momentum", but LARS's includes the learning rate
STATE_MEANING = {"sgd": "sgd momentum", "lars": "lars velocity", "adamw": "adam moments", "lamb": "adam moments"}


def check_compatible(state, cfg, shapes: dict, saved_optimizer: str | None = None) -> None:
    """Raise :class:`IncompatibleCheckpoint` listing every parameter whose shape differs or is missing,
    or when the optimizer state was saved by an optimizer (``saved_optimizer``, the file's attribute)
    whose state means something else."""
    flat, problems = state.model.flat, []
    logical = getattr(state.model, "logical_shape", lambda s: s.shape)
    if hasattr(state.model, "logical_params"):   # the whole model's (a pipeline stage holds some of it)
        want = {parameter_path("model", name): tuple(shape) for name, shape in state.model.logical_params()}
    else:
        want = {parameter_path("model", s.name): tuple(logical(s)) for s in flat.slots}
    for path, shape in want.items():
        if path not in shapes:
            problems.append(f"{path}: missing in the checkpoint (model has {shape})")
        elif tuple(shapes[path]) != shape:
            problems.append(f"{path}: checkpoint {tuple(shapes[path])}, model {shape}")
    extra = sorted(p for p in shapes if p.startswith("/model/") and p not in want)
    problems += [f"{p}: in the checkpoint, not in the model" for p in extra]
    fresh = "or start fresh (--resume '' or another checkpoint.dir)"
    if problems:  # the model knows which of its settings (or its data's shape) the shapes come from
        raise IncompatibleCheckpoint(f"the checkpoint does not fit this model ({cfg.model.kind}: its "
                                     f"settings or its data's shape differ); {state.model.checkpoint_hint(shapes)}, "
                                     f"{fresh}:\n  " + "\n  ".join(problems))
    for state_name in state.optimizer.state():
        missing = [s.name for s in flat.slots if parameter_path(f"optim/{state_name}", s.name) not in shapes]
        if missing:
            saved = [n for n, states in OPTIMIZER_STATES.items()
                     if all(parameter_path(f"optim/{s}", missing[0]) in shapes for s in states)]
            name = f"optim.name={saved[0]}" if saved else "the optim.name it was saved with"
            raise IncompatibleCheckpoint(f"the checkpoint has no optimizer state {state_name!r} for optim.name="
                                         f"{cfg.optim.name!r}: it was saved with another optimizer; resume "
                                         f"with --set {name}, {fresh}")
    # the names match, but the same name may mean another thing (SGD's momentum against LARS's velocity)
    mine = cfg.optim.name
    if saved_optimizer in STATE_MEANING and STATE_MEANING[saved_optimizer] != STATE_MEANING.get(mine):
        raise IncompatibleCheckpoint(f"the checkpoint's optimizer state is optim.name={saved_optimizer}'s "
                                     f"({STATE_MEANING[saved_optimizer]}), not optim.name={mine}'s; resume with "
                                     f"--set optim.name={saved_optimizer}, {fresh}")


def needed_boxes(state, plan) -> list[list]:
    """Per buffer of :func:`~.ownership.buffer_shares` (the parameters, each optimizer state), the
    boxes of the logical arrays this rank holds, flagged ``owned`` where it checksums them at a load
    (the owners of a save in this layout: one rank per element), and an empty box of every logical
    array it holds nothing of (so every rank reads every one of them as boxes, none as rows). What
    :func:`restore` fills; collective over the pipeline group (the stages' slot names)."""
    smap = slot_map(state.model, plan)
    layout = []
    for share in buffer_shares(state, plan):
        boxes = share_boxes(share, smap, owned_only=False)
        have = {b.path for b in boxes}
        for name, shape in logical_arrays(state.model):
            path, none = parameter_path(share.group, name), (0,) * len(shape)
            if path not in have:
                boxes.append(Box(path, none, none, 0, 0, none, None, False, tuple(shape)))
        layout.append(boxes)
    return layout


def wanted(layout: list[list]) -> list:
    """The request of :func:`~hpctrain.ckpt.read.load_checkpoint` for :func:`needed_boxes`' boxes."""
    return [(b.path, b.start, b.count, b.owned, b.whole) for boxes in layout for b in boxes]


def restore(state, plan, loaded, layout, log, saved_compress=None) -> None:
    """Load ``loaded`` (read by :func:`~hpctrain.ckpt.read.load_checkpoint` with :func:`wanted`
    (``layout``), ``layout`` being :func:`needed_boxes`) into ``state`` (a
    :class:`~hpctrain.training.state.TrainingState`, laid out by ``plan``). Local."""
    cfg, world = plan.cfg, plan.world
    check_compatible(state, cfg, loaded.shapes, loaded.attrs.get("optimizer"))
    if loaded.unfit:   # the shapes fit (checked): a bug, not a user's mistake
        raise RuntimeError(f"{loaded.path}: the boxes of {', '.join(sorted(loaded.unfit))} do not fit its arrays")
    dev, flat, opt = plan.device, state.model.flat, state.optimizer
    if getattr(plan, "param_slots", None) is not None:   # ZeRO-3: no gather reads the chunks while they change
        plan.param_slots.stale()
    arrays = iter(loaded.boxes)
    for share, boxes in zip(buffer_shares(state, plan), layout):
        fill(share, boxes, arrays)
    full = loaded.full
    getattr(opt, "masters_changed", lambda: None)()   # (dist.offload: its host masters follow the parameters)
    if hasattr(opt, "t"):
        opt.t = int(full["/optim/step_count"][0])
    position = dict(zip(POSITION_FIELDS, (int(v) for v in full["/data/position"])))
    state.step = position["global_step"]
    if (position["shuffle_seed"], position["n_samples"]) != (cfg.data.shuffle_seed, state.sampler.n):
        log.warn(f"the checkpoint was saved with data.shuffle_seed={position['shuffle_seed']} on "
                 f"{position['n_samples']} samples, this run has {cfg.data.shuffle_seed} on {state.sampler.n}: "
                 f"the data order differs from the saved run's from here on (not a bit-exact continuation)")
    saved_dtype = loaded.dtypes[parameter_path("model", flat.slots[0].name)]
    if saved_dtype != np.dtype(dev.dtype):
        log.warn(f"the checkpoint holds {saved_dtype} parameters, this run computes in {np.dtype(dev.dtype)}: "
                 f"parameters and optimizer state are cast")
    if position["global_batch"] != cfg.train.global_batch:
        log.warn(f"the checkpoint was saved with train.global_batch={position['global_batch']}, this run uses "
                 f"{cfg.train.global_batch}: the data order continues from step {state.step} of the new "
                 f"batch size, so some samples of the current epoch may repeat or be skipped")
    scaled = full.get("/precision/loss_scale")
    if getattr(state, "loss_scale", None) is not None and scaled is not None:  # else: the initial scale
        state.loss_scale.load(np.asarray(scaled))
    own_rows, saved_world = loaded.own_rows, loaded.world_size
    rng = own_rows.get("/rng/pcg64")
    state.rng = rng_from_array(rng) if rng is not None else fresh_rng(cfg.train.seed, world.rank, state.step)
    restore_compression(state.compression, cfg, world.size, own_rows, saved_world, saved_compress, log,
                        loaded.across_ranks)
    if saved_world != world.size:
        log.info(f"resharded from {saved_world} to {world.size} rank(s): parameters and optimizer state "
                 f"re-sliced; per-rank state (RNG) kept for ranks < {min(saved_world, world.size)}"
                 + (f", fresh for ranks >= {saved_world}" if world.size > saved_world else
                    f", dropped for saved ranks >= {world.size}"))

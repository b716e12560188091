"""What a checkpoint holds: the training state as named logical arrays, and back.

Every array is an :class:`Entry`: a path in the file, its full (logical) shape and dtype, and a
function giving rows [lo, hi) as a host array. Two kinds:

  * replicated (``per_rank=False``): identical on every rank (parameters, optimizer state, data
    position); written as disjoint row slices by all ranks, read whole at any world size.
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
from .format import OPTIMIZER_STATES

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
    rows: Callable[[int, int], np.ndarray]      # host rows [lo, hi); per-rank: called with (rank, rank + 1)
    per_rank: bool = False


def _flat_entry(path, to_host, buf, slot, dtype):
    """A parameter-shaped entry over ``slot`` of the flat array ``buf``; ``to_host`` brings a slice
    to the host (the device's, for device buffers; ``np.asarray`` for host ones)."""
    def rows(lo, hi, slot=slot, buf=buf):
        row = slot.size // slot.shape[0]
        part = buf[slot.offset + lo * row:slot.offset + hi * row]
        return to_host(part).reshape((hi - lo,) + tuple(slot.shape[1:]))
    return Entry(path, tuple(slot.shape), np.dtype(dtype), rows)


def _host_entry(path, array, per_rank=False):
    array = np.asarray(array)
    if per_rank:
        return Entry(path, (None,) + array.shape, array.dtype, lambda lo, hi: array[None], per_rank=True)
    return Entry(path, array.shape, array.dtype, lambda lo, hi: array[lo:hi])


def parameter_path(group: str, name: str) -> str:
    """'fc0.weight' in group 'model' -> '/model/fc0/weight' (a group per layer)."""
    return f"/{group}/" + "/".join(name.split("."))


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


def _slot_entries(group, model, to_host, buf, dtype, drifted: list) -> list[Entry]:
    """One entry per parameter slot of the flat array ``buf``: its logical array, gathered from
    the tensor group (collective over it) when the model splits it (``tensor_layout``); a
    replicated array that differs across the tensor group is named in ``drifted``."""
    flat, layout = model.flat, getattr(model, "tensor_layout", None)
    if layout is None:
        return [_flat_entry(parameter_path(group, s.name), to_host, buf, s, dtype) for s in model.flat.slots]
    return [_host_entry(parameter_path(group, s.name),
                        layout.logical(s.name, np.asarray(to_host(flat.view(buf, s.name))), drifted))
            for s in flat.slots]


def _whole_model(entries, model, comm, groups, drifted: list) -> list[Entry]:
    """A pipeline stage's parameter and optimizer entries made the whole model's: each stage's
    arrays brought to the host and all-gathered over the pipeline group ``comm`` (so every rank
    writes its rows of every array, as without a pipeline), in the whole model's order. The tied
    table, which the first and last stage both hold, is taken from the first; a copy that differs
    is named in ``drifted``."""
    mine = {e.path: np.asarray(e.rows(0, e.shape[0])) for e in entries}
    stages = comm.allgather(mine)
    out = []
    for group in groups:
        for name, _ in model.logical_params():
            path = parameter_path(group, name)
            held = [stage[path] for stage in stages if path in stage]
            if any(not np.array_equal(held[0], other) for other in held[1:]):
                drifted.append(f"{path}: the pipeline's first and last stage hold different copies")
            out.append(_host_entry(path, held[0]))
    return out


def _check_replicas(drifted: list) -> None:
    if drifted:
        raise RuntimeError("tensor or pipeline parallelism kept the replicated arrays apart (not saved: the file "
                           "would hold one rank's copy): " + "; ".join(drifted))


def training_state(state, plan) -> list[Entry]:
    """Every array of ``state`` (a :class:`~hpctrain.training.state.TrainingState`) that a bit-exact
    restart needs, in file order. Parameters and optimizer state are logical arrays: a ZeRO share or
    a tensor-parallel piece is gathered (collectives over ``plan``'s groups), so the file does not
    depend on how the run was split."""
    dev, flat, opt, sampler, cfg = plan.device, state.model.flat, state.optimizer, state.sampler, plan.cfg
    drifted = []
    params, to_host = flat.data, dev.to_host
    if getattr(plan, "param_slots", None) is not None:   # ZeRO-3: the whole parameters assembled on the host
        params, to_host = plan.param_slots.whole(plan.dp.comm), np.asarray
    entries = _slot_entries("model", state.model, to_host, params, dev.dtype, drifted)
    sdev = getattr(opt, "state_device", dev)   # (dist.offload: the state is in host memory)
    for state_name, buf in opt.state().items():
        to_host = sdev.to_host
        if getattr(opt, "shards", None) is not None:  # ZeRO-1: the whole state assembled on the host (collective)
            buf, to_host = opt.shards.gather(plan.dp.comm, sdev.to_host(buf), flat.size), np.asarray
        entries += _slot_entries(f"optim/{state_name}", state.model, to_host, buf, dev.dtype, drifted)
    if getattr(plan, "pipeline", 1) > 1:   # every stage's arrays on every rank (collective over the pipeline)
        entries = _whole_model(entries, state.model, plan.grid.pipeline.comm, ["model", *(
            f"optim/{name}" for name in opt.state())], drifted)
    if getattr(state.model, "tensor_layout", None) is not None or getattr(plan, "pipeline", 1) > 1:
        from ..reliability.fail_together import agree

        agree(plan.world, _check_replicas, drifted)  # one verdict on every rank, before any writing
    entries.append(_host_entry("/optim/step_count", np.array([getattr(opt, "t", 0)], np.int64)))
    epoch, in_epoch = sampler.position(state.step)
    entries.append(_host_entry("/data/position", np.array(
        [state.step, epoch, in_epoch, cfg.train.global_batch, cfg.data.shuffle_seed, sampler.n], np.int64)))
    entries.append(_host_entry("/rng/pcg64", rng_to_array(state.rng), per_rank=True))
    if getattr(state, "loss_scale", None) is not None:   # fp16: the same on every rank
        entries.append(_host_entry("/precision/loss_scale", np.array(state.loss_scale.state(), np.float64)))
    entries += [_host_entry(path, row, per_rank=True) for path, row in compression_rows(state.compression, plan.world)]
    return entries


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


def restore(state, plan, full: dict, own_rows: dict, saved_world: int, log, saved_compress=None,
            across_ranks=None, saved_optimizer: str | None = None) -> None:
    """Load arrays read by :func:`~hpctrain.ckpt.read.load_checkpoint` into ``state`` (a
    :class:`~hpctrain.training.state.TrainingState`, laid out by ``plan``; ``across_ranks``: the
    :attr:`~hpctrain.ckpt.read.LoadedCheckpoint.across_ranks`; ``saved_optimizer``: the file's
    ``optimizer`` attribute)."""
    cfg, world = plan.cfg, plan.world
    check_compatible(state, cfg, {p: a.shape for p, a in full.items()}, saved_optimizer)
    dev, flat, opt = plan.device, state.model.flat, state.optimizer
    layout = getattr(state.model, "tensor_layout", None)
    mine = (lambda name, a: a) if layout is None else layout.local  # noqa: E731  (this rank's piece)
    if getattr(plan, "param_slots", None) is not None:   # ZeRO-3: this rank's chunks of (its pieces of) them
        plan.param_slots.load(np.concatenate([np.asarray(mine(s.name, full[parameter_path("model", s.name)]))
                                              .reshape(-1) for s in flat.slots]))
    else:
        for s in flat.slots:
            dev.copy_from_host(flat.view(flat.data, s.name), mine(s.name, full[parameter_path("model", s.name)]))
    sdev = getattr(opt, "state_device", dev)   # (dist.offload: the state is in host memory)
    for state_name, buf in opt.state().items():
        if getattr(opt, "shards", None) is not None:  # ZeRO: this rank's chunks of (its tensor pieces of) the arrays
            whole = np.concatenate([np.asarray(mine(s.name, full[parameter_path(f"optim/{state_name}", s.name)]))
                                    .reshape(-1) for s in flat.slots])
            sdev.copy_from_host(buf, opt.shards.take(whole).astype(dev.dtype, copy=False))
            continue
        for s in flat.slots:
            sdev.copy_from_host(flat.view(buf, s.name), mine(s.name, full[parameter_path(f"optim/{state_name}", s.name)]))
    getattr(opt, "masters_changed", lambda: None)()   # (dist.offload: its host masters follow the parameters)
    if hasattr(opt, "t"):
        opt.t = int(full["/optim/step_count"][0])
    position = dict(zip(POSITION_FIELDS, (int(v) for v in full["/data/position"])))
    state.step = position["global_step"]
    if (position["shuffle_seed"], position["n_samples"]) != (cfg.data.shuffle_seed, state.sampler.n):
        log.warn(f"the checkpoint was saved with data.shuffle_seed={position['shuffle_seed']} on "
                 f"{position['n_samples']} samples, this run has {cfg.data.shuffle_seed} on {state.sampler.n}: "
                 f"the data order differs from the saved run's from here on (not a bit-exact continuation)")
    saved_dtype = full[parameter_path("model", flat.slots[0].name)].dtype
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
    rng = own_rows.get("/rng/pcg64")
    state.rng = rng_from_array(rng) if rng is not None else fresh_rng(cfg.train.seed, world.rank, state.step)
    restore_compression(state.compression, cfg, world.size, own_rows, saved_world, saved_compress, log,
                        across_ranks or {})
    if saved_world != world.size:
        log.info(f"resharded from {saved_world} to {world.size} rank(s): parameters and optimizer state "
                 f"re-sliced; per-rank state (RNG) kept for ranks < {min(saved_world, world.size)}"
                 + (f", fresh for ranks >= {saved_world}" if world.size > saved_world else
                    f", dropped for saved ranks >= {world.size}"))

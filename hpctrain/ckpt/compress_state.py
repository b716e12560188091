"""The compressors' per-rank state in a checkpoint (/compress), and back.

Error feedback's residuals, PowerSGD's Q and momentum correction's velocities are per rank: row r of
each /compress/<key> dataset is rank r's. :func:`restore_compression` first zeroes the state, then:

  * same ``dist.compress`` / ``compress_scope`` / ``tensor_parallel`` / ``compress_momentum`` and
    bucket layout, same world size: each rank takes its own row (a bit-exact continuation);
  * the same at another world size, with scope "all" and no tensor parallelism: every rank takes
    the mean of the saved rows (float64, rounded once to float32), which keeps the update the
    residuals still owe, (1/N') sum_j r'_j = (1/N) sum_i r_i; Q is the same on every rank;
  * anything else keeps the zeros, with a log line (a rollback to a file saved before
    compression started too).
Residuals and velocities are sums over ``train.grad_accum_steps`` (k) micro-batches, so a restored
row is multiplied by k_now / k_saved. Why the mean is right: docs/checkpoint-format.md, "Resharding".
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

LENGTHS = "/compress/lengths"


class SavedCompress(NamedTuple):
    """What a checkpoint's compressor state was made under (:func:`.manager._saved_compress`);
    the defaults are those of files from before each setting was stored."""

    compress: str = "none"
    scope: str = "all"
    tensor_parallel: int = 1   # at another t the data groups, and which rank holds which residual, differ
    momentum: bool = False     # momentum correction: the rows hold velocities too
    grad_accum_steps: int = 1  # residuals are sums of this many micro-batches' gradients
    layout: str = ""           # the buckets' layout signature (rows are per bucket, in its element order)


def compression_rows(comp, world) -> list[tuple[str, np.ndarray]]:
    """This rank's row of each /compress/<key> dataset of the compressors' state ``comp`` (a
    :class:`~hpctrain.compress.gradients.GradientCompression`, or None), as (path, row).

    Collective over ``world.comm`` (an all-gather of names and shapes): every rank must create the
    same datasets, but ranks may hold different keys (scope inter: only ranks
    that send across nodes have residuals) or lengths differing by one (chunks
    of a bucket). So the union of keys is written, each row zero-padded to the
    largest shape, and /compress/lengths (world, keys) keeps each row's true
    element count (0: this rank had no such state).
    """
    if comp is None:
        return []
    mine = {k: np.asarray(v, np.float32) for k, v in comp.state().items()}
    everyone = world.comm.allgather({k: v.shape for k, v in mine.items()})
    keys = sorted(set().union(*everyone))
    rows = []
    for k in keys:
        shapes = [s[k] for s in everyone if k in s]
        ndim = max(len(sh) for sh in shapes)
        full = tuple(max(sh[d] for sh in shapes if len(sh) == ndim) for d in range(ndim))
        row = np.zeros(full, np.float32)
        if k in mine and mine[k].ndim == ndim:
            row[tuple(slice(0, d) for d in mine[k].shape)] = mine[k]
        rows.append((f"/compress/{k}", row))
    if keys:
        rows.append((LENGTHS, np.array([mine[k].size if k in mine else 0 for k in keys], np.int64)))
    return rows


def restore_compression(comp, cfg, world_size: int, own_rows: dict, saved_world: int, saved_compress, log,
                        across_ranks: dict) -> None:
    """Load the compressor state of a checkpoint into ``comp`` (None: nothing to do) by the rules
    above, for this run's config ``cfg`` at world size ``world_size``.

    ``own_rows``: this rank's row of each per-rank dataset (absent beyond the saved world);
    ``across_ranks`` (read at another world size only): the mean row of each float /compress
    dataset and every row of /compress/lengths; ``saved_compress``: a :class:`SavedCompress`
    (or its leading fields as a tuple)."""
    if comp is None:
        return
    # whatever is not restored starts from zero: a rollback must not keep the state of the steps it
    # undoes (a NaN residual from the bad step, or velocities past a checkpoint saved before compression)
    comp.load_state({})
    names = own_rows if saved_world == world_size else across_ranks
    keys = sorted(p[len("/compress/"):] for p in names if p.startswith("/compress/") and p != LENGTHS)
    if not keys:
        return
    saved = SavedCompress(*(saved_compress or ()))
    k, cfg = cfg.train.grad_accum_steps, cfg.dist
    now = SavedCompress(cfg.compress, cfg.compress_scope, cfg.tensor_parallel, cfg.compress_momentum, k,
                        getattr(comp, "layout", ""))
    factor = now.grad_accum_steps / saved.grad_accum_steps
    why = None
    if saved[:4] != now[:4]:
        why = (f"saved with (compress, scope, tensor_parallel, momentum) {tuple(saved[:4])}, "
               f"this run has {tuple(now[:4])}")
    elif saved.layout != now.layout:
        why = ("saved with another bucket layout (dist.bucket_split, bucket sizes, or the model's parameter "
               "order), or by a version that did not record it: its rows would meet other parameters")
    elif saved_world != world_size and (cfg.compress_scope != "all" or cfg.tensor_parallel > 1):
        why = (f"saved with {saved_world} rank(s), this run has {world_size}, and with "
               + ("compress_scope = 'inter' a rank's rows are its share of the saved job's cross-node chunks"
                  if cfg.compress_scope != "all" else "tensor parallelism rows hold different pieces of the matrices"))
    elif saved_world != world_size and not _whole_rows(across_ranks.get(LENGTHS), keys, across_ranks):
        why = f"saved with {saved_world} rank(s), this run has {world_size}, and the saved ranks' rows differ in length"
    if why:
        log.info(f"compression state (error-feedback residuals, momentum correction's velocities, PowerSGD's Q) "
                 f"not restored: {why}; it starts from zero")
        return
    if factor != 1:
        log.info(f"compression state: residuals and velocities were summed over a saved "
                 f"train.grad_accum_steps={saved.grad_accum_steps}, this run sums {now.grad_accum_steps}; "
                 f"scaled by {factor:g} (the update they owe is kept)")
    if saved_world != world_size:
        comp.load_state({k: _scaled(k, across_ranks[f"/compress/{k}"], factor).astype(np.float32) for k in keys})
        log.info(f"compression state restored at another world size: each of the {world_size} rank(s) starts from the "
                 f"mean of the {saved_world} saved ranks' residuals, velocities and PowerSGD's Q (what the update "
                 f"still owes is kept)")
        return
    lengths = own_rows.get(LENGTHS)
    state = {}
    for i, k in enumerate(keys):
        row = own_rows[f"/compress/{k}"]
        n = int(lengths[i]) if lengths is not None else row.size
        if n == row.size:
            state[k] = _scaled(k, row, factor)
        elif n:
            state[k] = _scaled(k, row.reshape(-1)[:n] if row.ndim == 1 else row, factor)  # 1-D: padded by one at most
    comp.load_state(state)


def _scaled(key, row, factor):
    """Residuals and velocities times ``factor`` (k_now / k_saved, in float64, rounded once); Q as it is."""
    if factor == 1 or key.startswith("q/"):
        return row
    return (np.asarray(row, np.float64) * factor).astype(np.float32)


def _whole_rows(lengths, keys, means) -> bool:
    """Every saved rank held every key, unpadded (scope all: whole buckets and matrices on every rank)."""
    if lengths is None or lengths.shape[1:] != (len(keys),):
        return False
    full = np.array([means[f"/compress/{k}"].size for k in keys], np.int64)
    return bool((lengths == full).all())

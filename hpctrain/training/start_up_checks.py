"""What every rank must agree on before training, checked at start-up: the same data, the same
gradient buckets (per pipeline stage), data groups that lie alike on the nodes (per stage, under
tensor parallelism), the same share of a pipeline's tied table on its first and last stage. A
disagreement is one clear error on every rank (:func:`~hpctrain.reliability.fail_together.agree`),
never the hang that mismatched collectives would be."""

from __future__ import annotations

from ..comm.buckets import layout_signature
from ..comm.grid import check_same_reduction
from ..errors import ConfigError, DataError
from ..reliability.fail_together import agree
from ..runtime import oversubscribed_note


def agree_at_start_up(world, plan, data, log) -> None:
    """The checks of the module docstring over ``world``, and the device's and ranks' warnings said
    once (rank 0's ``log``). Collective over ``world.comm``."""
    if plan.device.gemm_note:  # train.gemm = auto on a GPU without a usable CuPy: slow GEMMs, say why once
        log.warn(plan.device.gemm_note)
    if getattr(plan.device, "attention_note", None):  # the cuBLAS attention failed its start-up check
        log.warn(plan.device.attention_note)
    # a rank with more threads than cores (a launcher's binding): said once, for every such rank
    crowded = [(r, note) for r, note in enumerate(world.comm.allgather(oversubscribed_note()))
               if note]
    if crowded:
        log.warn(f"rank(s) {','.join(str(r) for r, _ in crowded)}: {crowded[0][1]}")
    # Ranks reading different files (node-local copies that differ) would
    # train on garbage or mismatch in Bcast; compare what each rank sees.
    agree(world, _check_same_data, world.comm.allgather(data.signature), plan.cfg.data.train)
    # Buckets reduced in a different order or size on some rank would pair
    # collectives wrongly and hang: compare the layouts first.
    # (a pipeline's stages hold different parameters: the ranks of each stage must agree)
    layouts = world.comm.allgather((plan.grid.stage, layout_signature(plan.buckets, plan.device.dtype)))
    agree(world, check_same_layout, layouts)
    if plan.grid.tensor is not None:   # (a stage's tensor ranks hold the replicas: per stage)
        placed = world.comm.allgather((plan.grid.stage, tuple(node for node, _ in plan.dp.where)))
        for stage in sorted({s for s, _ in placed}):
            agree(world, check_same_reduction, [p for s, p in placed if s == stage], plan.cfg.dist.allreduce)
    if plan.pipeline > 1:
        # the tied table's gradient is summed chunk by chunk between the first and last stage
        agree(world, check_tied_shares, world.comm.allgather(plan.tied_share()))


def check_same_layout(layouts):
    """Every rank of a pipeline stage (of the world, without one) must reduce the same gradient
    buckets in the same order. ``layouts``: (stage, layout signature) per rank."""
    by_stage: dict = {}
    for stage, signature in layouts:
        by_stage.setdefault(stage, set()).add(signature)
    if any(len(signatures) > 1 for signatures in by_stage.values()):
        detail = ", ".join(f"rank {r}: {h}" + (f" (stage {s})" if len(by_stage) > 1 else "")
                           for r, (s, h) in enumerate(layouts))
        raise ConfigError(f"ranks disagree on the gradient bucket layout ({detail}); every rank must build "
                          f"the same model with the same dist.bucket_mb and train.dtype, or the all-reduce "
                          f"would deadlock")


def check_tied_shares(shares):
    """A pipeline's first and last stage sum their copies of the tied table's gradient rank by rank
    (each data rank with the same data rank of the other stage): under ZeRO both must own the same
    part of it. ``shares``: per rank, None or (pipeline group, the part of ``wte`` it owns)."""
    owned: dict = {}
    for share in filter(None, shares):
        owned.setdefault(share[0], set()).add(share[1])
    if any(len(parts) > 1 for parts in owned.values()):
        raise ConfigError("dist.zero with dist.pipeline_parallel: the first and last stage's data groups own different "
                          "parts of the tied embedding's gradient (their ZeRO chunks follow how each group lies on "
                          "the nodes, with dist.allreduce=hierarchical or auto), so its two copies could not be "
                          "summed part by part; use dist.allreduce = ring, rhd, mpi or naive, or a world whose "
                          "stages lie alike on the nodes")


def _check_same_data(seen, path):
    if len(set(seen)) > 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
        raise DataError(f"ranks see different datasets at {path!r} ({detail}); "
                        f"every rank must read the same file (check node-local copies)")

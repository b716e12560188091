"""The process grid (data x tensor x pipeline): who splits a layer with whom, who averages with
whom, who passes activations to whom. Every group is built here (:func:`make_grid`, collective over
the world's communicator).

The world is p consecutive blocks of world size / p ranks, one pipeline *stage* each
(``dist.pipeline_parallel``). Inside a stage, t consecutive ranks form a *tensor group*
(``dist.tensor_parallel``): consecutive so that a group stays inside a node whenever t divides the
ranks per node, where its per-layer all-reduces are cheapest. A stage's ranks with the same tensor
rank form a *data group*, which averages gradients with ``dist.allreduce`` as the whole world does
without model parallelism. The ranks at the same place in every stage form a *pipeline group*
(activations forward, gradients backward), and its first and last stage the *embedding group* (the
tied embedding's two copies). So a stage's groups stay together, and a slow link between nodes falls
between stages:

    rank = stage * (d * t) + data rank * t + tensor rank
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..runtime import World
from .collectives import sub_world


@dataclass
class Grid:
    """This rank's groups. ``tensor``: the t ranks that split each block (None when t = 1);
    ``data``: the ranks it averages gradients with (the world itself when t = p = 1);
    ``pipeline``: the p ranks of its place in every stage (None when p = 1); ``embedding``: that
    group's first and last stage, on those two stages only."""

    t: int
    tensor: World | None
    data: World
    p: int = 1
    pipeline: World | None = None      # this rank's pipeline group (None when p = 1)
    embedding: World | None = None     # stage 0 and stage p - 1 of it (None elsewhere, and when p = 1)

    @property
    def tensor_rank(self) -> int:
        return 0 if self.tensor is None else self.tensor.rank

    @property
    def stage(self) -> int:
        return 0 if self.pipeline is None else self.pipeline.rank

    @property
    def last_stage(self) -> bool:
        """Whether this rank computes the loss (the last stage; every rank when p = 1)."""
        return self.stage == self.p - 1

    @property
    def scores(self) -> bool:
        """Whether this rank's loss statistics count in the world's sums: one rank per data group
        (tensor rank 0) of the last stage; the others computed the same or none."""
        return self.tensor_rank == 0 and self.last_stage

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.tensor is None and self.p == 1:
            return f"data parallel over {self.data.size} rank(s)"
        parts = [f"data parallel {self.data.size}"]
        mine = [f"data rank {self.data.rank} of {self.data.size}"]
        if self.tensor is not None:
            parts.insert(0, f"tensor parallel t = {self.t}")
            mine.insert(0, f"tensor rank {self.tensor.rank} of {self.t}")
        if self.p > 1:
            parts.append(f"pipeline p = {self.p}")
            mine.append(f"stage {self.stage} of {self.p}")
        return " x ".join(parts) + ": this rank is " + ", ".join(mine)


def check_divides(size: int, t: int, p: int = 1) -> None:
    """:class:`ConfigError` unless t x p divides the world size ``size``."""
    if t < 1 or size % t:
        raise ConfigError(f"dist.tensor_parallel={t} does not divide the world size {size}: tensor groups "
                          f"are t consecutive ranks; launch a multiple of {t} ranks or choose t among "
                          f"{', '.join(str(k) for k in range(1, size + 1) if size % k == 0)}")
    if p < 1 or size % (t * p):
        raise ConfigError(f"dist.pipeline_parallel={p} x dist.tensor_parallel={t} does not divide the world size "
                          f"{size}: each of the p stages holds world size / p ranks, whole tensor groups; launch "
                          f"a multiple of {t * p} ranks")


# strategies whose order of additions depends only on the group's size (not on where its ranks run)
ORDER_BY_SIZE = ("ring", "rhd", "naive")


def check_same_reduction(layouts: list, allreduce: str) -> None:
    """Replicated parameters (embeddings, LayerNorms) get the same gradient on every tensor rank,
    and stay identical only if every data group adds them in the same order. ``layouts``: each
    rank's data group as the node of each member (allgathered). Groups laid out alike (t divides
    the ranks per node, or one node) run any strategy alike; otherwise only those in
    :data:`ORDER_BY_SIZE` do. :class:`ConfigError` else."""
    if allreduce not in ORDER_BY_SIZE and len(set(layouts)) > 1:
        raise ConfigError(f"dist.allreduce={allreduce} with dist.tensor_parallel: the data-parallel groups lie "
                          f"differently across the nodes ({sorted(set(layouts))}), so this strategy may add the "
                          f"replicated parameters' gradients in a different order in each group and the tensor "
                          f"ranks' copies would drift apart; choose t dividing the ranks per node, or "
                          f"dist.allreduce = ring, rhd or naive")


def align_auto(grid: Grid, allreduce) -> None:
    """``dist.allreduce = auto`` measured its fits in each data group separately (and at the same
    time, each group loading the others): every group takes tensor rank 0's, so all pick alike.
    Collective over the tensor group; nothing to do for other strategies or t = 1."""
    if grid.tensor is not None and hasattr(allreduce, "adopt_fits"):
        allreduce.adopt_fits(grid.tensor.comm.bcast(allreduce.fits, root=0))


def groups(size: int, t: int, p: int = 1) -> tuple[list, list, list]:
    """(tensor groups, data groups, pipeline groups) of a world of ``size`` ranks, as lists of world
    ranks (the layout in the module docstring)."""
    per_stage = size // p
    tensor = [list(range(g * t, (g + 1) * t)) for g in range(size // t)]
    data = [list(range(s * per_stage + r, (s + 1) * per_stage, t)) for s in range(p) for r in range(t)]
    pipeline = [list(range(r, size, per_stage)) for r in range(per_stage)]
    return tensor, data, pipeline


def place_of(rank: int, size: int, t: int, p: int) -> tuple[int, int, int]:
    """(stage, data rank, tensor rank) of world rank ``rank``."""
    per_stage = size // p
    return rank // per_stage, rank % per_stage // t, rank % t


def make_grid(world: World, t: int, p: int = 1) -> Grid:
    """Split ``world`` into p stages of tensor groups of ``t`` consecutive ranks and the data groups
    across them, and the pipeline and embedding groups across the stages. Collective over
    ``world.comm`` (when t > 1 or p > 1). Raises :class:`ConfigError` (on every rank alike) when t x p
    does not divide the world size."""
    check_divides(world.size, t, p)
    if t == 1 and p == 1:
        return Grid(1, None, world)
    stage, _, tensor_rank = place_of(world.rank, world.size, t, p)
    tensor = data = world
    if t > 1:
        tensor = sub_world(world, world.comm.Split(color=world.rank // t, key=world.rank))
    if t > 1 or p > 1:
        data = sub_world(world, world.comm.Split(color=stage * t + tensor_rank, key=world.rank))
    pipeline = embedding = None
    if p > 1:
        per_stage = world.size // p
        pipeline = sub_world(world, world.comm.Split(color=world.rank % per_stage, key=world.rank))
        ends = stage in (0, p - 1)
        split = world.comm.Split(color=world.rank % per_stage if ends else _undefined(), key=world.rank)
        embedding = sub_world(world, split) if ends else None
    return Grid(t, tensor if t > 1 else None, data, p, pipeline, embedding)


def _undefined():
    from mpi4py import MPI

    return MPI.UNDEFINED

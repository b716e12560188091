"""The process grid of tensor parallelism: who splits a layer with whom, who averages with whom.

With ``dist.tensor_parallel = t`` the world's ranks form groups of t consecutive ranks, the
*tensor groups* (ranks 0..t-1, t..2t-1, ...): consecutive so that a group stays inside a node
whenever t divides the ranks per node, where its per-layer all-reduces are cheapest. The ranks holding
the same tensor rank (world rank mod t) across the groups form a *data group*: world size / t
ranks with the same shard of every split matrix, which average their gradients with
``dist.allreduce`` exactly as the whole world does without tensor parallelism.

    grid = make_grid(world, t)          # collective over world.comm
    grid.tensor.rank, grid.data.rank    # this rank's place in each
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..runtime import World
from .collectives import sub_world


@dataclass
class Grid:
    """This rank's two groups. ``tensor``: the t ranks that split each block (None when t = 1);
    ``data``: the ranks it averages gradients with (the world itself when t = 1)."""

    t: int
    tensor: World | None
    data: World

    @property
    def tensor_rank(self) -> int:
        return 0 if self.tensor is None else self.tensor.rank

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.tensor is None:
            return f"data parallel over {self.data.size} rank(s)"
        return (f"tensor parallel t = {self.t} x data parallel {self.data.size}: this rank is tensor rank "
                f"{self.tensor.rank} of {self.t}, data rank {self.data.rank} of {self.data.size}")


def check_divides(size: int, t: int) -> None:
    """:class:`ConfigError` unless t divides the world size ``size``."""
    if t < 1 or size % t:
        raise ConfigError(f"dist.tensor_parallel={t} does not divide the world size {size}: tensor groups "
                          f"are t consecutive ranks; launch a multiple of {t} ranks or choose t among "
                          f"{', '.join(str(k) for k in range(1, size + 1) if size % k == 0)}")


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


def groups(size: int, t: int) -> tuple[list, list]:
    """(tensor groups, data groups) of a world of ``size`` ranks, as lists of world ranks."""
    return ([list(range(g * t, (g + 1) * t)) for g in range(size // t)],
            [list(range(r, size, t)) for r in range(t)])


def make_grid(world: World, t: int) -> Grid:
    """Split ``world`` into tensor groups of ``t`` consecutive ranks and the data groups across
    them. Collective over ``world.comm`` (when t > 1). Raises :class:`ConfigError` (on every
    rank alike) when t does not divide the world size."""
    check_divides(world.size, t)
    if t == 1:
        return Grid(1, None, world)
    tensor = world.comm.Split(color=world.rank // t, key=world.rank)
    data = world.comm.Split(color=world.rank % t, key=world.rank)
    return Grid(t, sub_world(world, tensor), sub_world(world, data))

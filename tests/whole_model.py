"""Helpers of the MPI tests that train a model split over ranks (tensor pieces, pipeline stages,
ZeRO shares) and compare it with an unsplit run: a run to its end, and the whole model's arrays."""

import numpy as np


def start(cfg, world):
    """A trainer of ``cfg`` over ``world``, built (a resume loaded), not run."""
    from hpctrain.observe.log import Log
    from hpctrain.training.trainer import Trainer

    return Trainer(cfg, world, Log(False))


def train(cfg, world):
    """A trainer of ``cfg`` over ``world``, run to its end (``train.steps``); (trainer, run result)."""
    trainer = start(cfg, world)
    return trainer, trainer.run()


def whole(trainer, buf=None):
    """Every parameter's logical array of the whole model, the same on every rank: this rank's
    pieces gathered over the tensor group, then every stage's over the pipeline group (the tied
    table from the first stage that holds it). ``buf``: a flat array of the model's layout (an
    optimizer state, without ZeRO) instead of the parameters."""
    model, grid = trainer.model, trainer.plan.grid
    buf = model.flat.data if buf is None else buf
    mine = {}
    for s in model.flat.slots:
        local = np.array(model.flat.view(buf, s.name))
        mine[s.name] = local if model.tensor_layout is None else model.tensor_layout.logical(s.name, local)
    stages = [mine] if grid.pipeline is None else grid.pipeline.comm.allgather(mine)
    out = {}
    for stage in stages:
        for name, array in stage.items():
            out.setdefault(name, array)
    return out

"""Write the step-0 checkpoint of a configuration: hpctrain's initial weights, zero optimizer state.

    python benchmarks/peers/init_checkpoint.py --config examples/mlp.toml --set ... --dir runs/init

Prints the path of ``DIR/ckpt-00000000.h5``. A comparison starts both trainers
from it: hpctrain with ``--resume FILE``, a peer by reading ``/model/fc<i>/weight``
(in, out) and ``/bias`` with plain h5py (docs/checkpoint-format.md). The
initial weights do not depend on the world size (rank 0's are broadcast), so
one 1-rank process writes it (plain python, no launcher; or under one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="hpctrain TOML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--dir", required=True, help="directory for ckpt-00000000.h5 (created)")
    args = p.parse_args(argv)
    sys.path.insert(0, REPO)
    from hpctrain.runtime import limit_threads_per_rank

    limit_threads_per_rank()
    from hpctrain.training.config_load import load_config
    from hpctrain.errors import UserError
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    world = init_world()
    # no resume, metrics or trace; no eval file (it is not needed to build the model)
    sets = args.set + [f"checkpoint.dir={json.dumps(args.dir)}", 'checkpoint.resume=""', 'train.metrics=""',
                       'train.trace=""', 'data.eval=""', "train.target_accuracy=0", "checkpoint.keep_last=0"]
    try:
        trainer = Trainer(load_config(args.config, sets), world, Log(False))
        path = trainer.checkpoints.save(trainer.state)
    except UserError as exc:
        if world.is_root:
            print(f"init_checkpoint: error: {exc}", file=sys.stderr)
        return 2
    if world.is_root:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

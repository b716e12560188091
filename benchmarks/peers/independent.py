"""N independent 1-rank hpctrain runs at once: how far the machine lets weak scaling go without communication.

    mpirun -n 2 python benchmarks/peers/independent.py --set train.global_batch=512 --set ... --resume CKPT

The yardstick for weak-scaling efficiency. Started by the same launcher as the
N-rank run it is compared with (so each rank gets the same cores, binding and
threads), every rank trains its own 1-rank copy of the configuration on
``MPI.COMM_SELF``: global batch = ``train.global_batch`` / N (the per-rank
batch of the N-rank run), no gradient all-reduce and no step statistics across
ranks. Whatever it loses against one rank alone (cores sharing caches, memory
bandwidth, a hypervisor's scheduling, clock boost) is the machine's; the N-rank
run's shortfall below it is hpctrain's communication and synchronisation.

So that rank 0's timed steps always run among N busy processes: every rank
builds its trainer (JIT, data, checkpoint) first, they all start the training
loop after one barrier on ``COMM_WORLD``, and ranks 1.. run ``steps`` x 1.5 + 10
steps. Rank 0 writes ``train.metrics`` (read by benchmarks/scaling.py as row
``independent``); the others write no metrics and each checkpoints, if the
configuration does, into ``<checkpoint.dir>/independent-rank<r>``.

Exit status: 0, or 2 with one message from rank 0 for a bad configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def per_rank_sets(cfg, rank: int, size: int) -> list[str]:
    """The --set overrides that turn the N-rank configuration ``cfg`` into rank ``rank``'s 1-rank copy."""
    if cfg.train.global_batch % size:
        raise ValueError(f"train.global_batch={cfg.train.global_batch} is not divisible by {size} ranks")
    sets = [f"train.global_batch={cfg.train.global_batch // size}",
            f"checkpoint.dir={json.dumps(os.path.join(cfg.checkpoint.dir, f'independent-rank{rank}'))}"]
    if rank:
        sets += [f"train.steps={cfg.train.steps * 3 // 2 + 10}", 'train.metrics=""', 'train.trace=""']
    return sets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="hpctrain TOML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--resume", default=None, help="checkpoint every copy starts from")
    args = p.parse_args(argv)
    sys.path.insert(0, REPO)
    from hpctrain.runtime import limit_threads_per_rank

    limit_threads_per_rank()
    from mpi4py import MPI

    from hpctrain.training.config_load import load_config
    from hpctrain.errors import UserError
    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.trainer import Trainer

    everyone = MPI.COMM_WORLD
    rank, size = everyone.Get_rank(), everyone.Get_size()
    sets = list(args.set) + ([f"checkpoint.resume={json.dumps(args.resume)}"] if args.resume else [])
    error = None
    try:
        cfg = load_config(args.config, sets)
        cfg = load_config(args.config, sets + per_rank_sets(cfg, rank, size))
        trainer = Trainer(cfg, init_world(MPI.COMM_SELF), Log(rank == 0))
    except (UserError, ValueError) as exc:
        error = str(exc) or type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - any failure must reach the allgather, or the others hang
        error = f"{type(exc).__name__}: {exc}"
    errors = everyone.allgather(error)  # every rank stops alike, rank 0 says why
    if any(errors):
        if rank == 0:
            print(f"independent: error: {next(e for e in errors if e)}", file=sys.stderr)
        return 2
    everyone.Barrier()  # the training loops start together
    trainer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

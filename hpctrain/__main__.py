"""Command line: ``python -m hpctrain <command>`` (under mpirun/srun or alone).

Commands
  train   train a model over all ranks of the launch (data, tensor and pipeline parallel)
  data    make, import or inspect datasets (``data synth``, ``data text``, ``data import``, ``data info``)
  sample  generate text from a GPT checkpoint (``sample --checkpoint FILE --prompt TEXT``)
  ckpt    list, verify or inspect checkpoints (``ckpt ls DIR``, ``ckpt verify FILE``, ``ckpt inspect FILE``)
  trace   join the per-rank timelines of ``train --trace DIR`` (``trace merge DIR -o FILE``)
  bench   rebuild a benchmark's table and plots from its JSON (``bench report DIR``)
  launch  run train under mpirun (or srun in an allocation) and restart it from the newest checkpoint
          after a failure (``launch -n N [--max-failures K] -- train ARGS``, ``launch --srun -- train ARGS``)
  info    per-rank topology, MPI library and thread level, h5py/HDF5, numba, CUDA
          (with ``--config``: the bytes per rank that config would take)

Exit codes: 0 ok; 2 a user error (printed once by rank 0); 3 the run finished but missed
train.target_accuracy, train.target_val_bpb or train.target_bpb_vs_bigram; 4 the watchdog ended a
stalled collective (dist.comm_timeout); 5 NaN/Inf or loss spikes the numerical guard may not skip
(guard.nonfinite), or more than guard.max_bad_steps bad steps; 6 launch gave up (more failures
than --max-failures, two in a row before a step, or no usable node left); 75 stopped by
SIGUSR1/SIGTERM after saving a checkpoint (run again with --resume auto); 1 anything else
(all ranks are aborted).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys

from .runtime import launched_rank, limit_threads_per_rank, yield_when_oversubscribed


# How long a rank other than 0 waits before it leaves, where it leaves without a collective that
# holds it until rank 0 has printed (a usage error: MPI is not up yet; a save that left a file HDF5
# cannot close: no MPI_Finalize). mpirun ends the whole job when the first rank exits non-zero, so
# a silent rank that left at once could kill rank 0 before it printed the message (seen in CI:
# 3 ranks on 2 cores, rc 2 and no message). Rank 0 exits at once and mpirun then ends the waiting
# ranks, so this costs nothing there; under srun without --kill-on-bad-exit (which waits for every
# task) such an error takes this long. Waiting, not exiting 0: a rank that parsed differently from
# rank 0 must still end the job, not leave rank 0 waiting in MPI_Init.
SILENT_RANK_GRACE_S = 5.0


def _let_rank_0_speak_first(is_root: bool) -> None:
    if not is_root:
        import time

        time.sleep(SILENT_RANK_GRACE_S)


class _Parser(argparse.ArgumentParser):
    """Usage errors are printed by rank 0 only (MPI is not up yet; the launcher's rank is read)."""

    def error(self, message):
        if launched_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"hpctrain: error: {message}", file=sys.stderr, flush=True)
        _let_rank_0_speak_first(launched_rank() == 0)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hpctrain", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    t = sub.add_parser("train", help="train data-parallel (run under mpirun -n N or srun)",
                       description="Train data-parallel. Example: mpirun -n 4 python -m hpctrain train "
                                   "--config examples/mlp.toml --set optim.lr=0.05")
    t.add_argument("--config", help="TOML file with [model] [data] [train] [optim] [dist] [checkpoint] [guard] "
                                    "sections")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set train.steps=500")
    t.add_argument("--ranks-per-node", type=int, metavar="K",
                   help="simulate nodes of K ranks on one machine (same as --set dist.ranks_per_node=K)")
    t.add_argument("--resume", metavar="auto|PATH",
                   help="continue from the newest valid checkpoint in checkpoint.dir (auto) or from PATH "
                        "(same as --set checkpoint.resume=...)")
    t.add_argument("--trace", metavar="DIR", help="write a Chrome trace per rank into DIR (same as --set "
                   "train.trace=DIR); join them with: python -m hpctrain trace merge DIR")
    t.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    t.set_defaults(func=cmd_train)

    from .data.cli import add_data_parser

    add_data_parser(sub)
    s = sub.add_parser("sample", help="generate text from a GPT checkpoint (no MPI launcher needed)",
                       description="Generate text from a GPT checkpoint, read and verified as a resume reads it. "
                                   "Example: python -m hpctrain sample "
                                   "--checkpoint runs/gpt/ckpt/ckpt-00001500.h5 --prompt 'def ' --tokens 300")
    s.add_argument("--checkpoint", required=True, metavar="FILE", help="a checkpoint of a model.kind = \"gpt\" run")
    s.add_argument("--prompt", default="\n", help="text the sample continues (default: a newline)")
    s.add_argument("--tokens", type=int, default=300, help="tokens (bytes) to generate (default 300)")
    s.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 = greedy, the most likely token every time (default 0.8)")
    s.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="draw only among the K most likely tokens; 0 = all (default 0)")
    s.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    s.set_defaults(func=cmd_sample)

    c = sub.add_parser("ckpt", help="list, verify or inspect checkpoints (no MPI needed)")
    csub = c.add_subparsers(dest="ckpt_command", required=True, metavar="action")
    cl = csub.add_parser("ls", help="checkpoints in DIR, newest first")
    cl.add_argument("dir")
    cl.add_argument("--verify", action="store_true", help="also read every byte and check the checksums")
    cl.set_defaults(func=lambda a: _ckpt("cmd_ls", a))
    cv = csub.add_parser("verify", help="check every dataset's checksum; exit 1 if any file is invalid")
    cv.add_argument("files", nargs="+", metavar="FILE")
    cv.set_defaults(func=lambda a: _ckpt("cmd_verify", a))
    ci = csub.add_parser("inspect", help="config, step, world size, datasets with shapes and sizes")
    ci.add_argument("file")
    ci.set_defaults(func=lambda a: _ckpt("cmd_inspect", a))

    tr = sub.add_parser("trace", help="timelines written by train --trace (no MPI needed)")
    trsub = tr.add_subparsers(dest="trace_command", required=True, metavar="action")
    tm = trsub.add_parser("merge", help="one Chrome trace with a track per rank (Perfetto, chrome://tracing)")
    tm.add_argument("dir", help="the --trace directory (trace-rank*.json)")
    tm.add_argument("-o", "--output", metavar="FILE", help="merged file (default DIR/trace.json)")
    tm.set_defaults(func=lambda a: _lazy("observe.trace", "cmd_merge", a))

    b = sub.add_parser("bench", help="benchmark reports (no MPI needed)")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="action")
    br = bsub.add_parser("report", help="rebuild the Markdown table and PNG plots from DIR/scaling.json")
    br.add_argument("dir", help="the output directory of benchmarks/scaling.py")
    br.set_defaults(func=lambda a: _lazy("observe.bench_report", "cmd_report", a))

    la = sub.add_parser("launch", help="run train under mpirun (or srun in an allocation) and restart it from "
                        "the newest checkpoint after a failure (no MPI in this process)",
                        description="python -m hpctrain launch -n N [--max-failures K] [mpirun options] -- "
                                    "train ARGS, or launch --srun [--max-failures K] [srun options] -- train ARGS "
                                    "inside a SLURM allocation: see hpctrain/reliability/launch.py and "
                                    "docs/reliability.md")
    la.add_argument("-n", type=int, metavar="N", help="ranks (mpirun -n)")
    la.add_argument("--srun", action="store_true",
                    help="start each run with srun inside this SLURM allocation; after a failure, on the nodes "
                         "that still work (sbatch --no-kill; jobs/requeue.sbatch)")
    la.add_argument("--max-failures", type=int, metavar="K",
                    help="restarts before giving up (default HPCTRAIN_MAX_FAILURES, else 3)")

    i = sub.add_parser("info", help="print topology and library support per rank (and with --config, the "
                                    "memory per rank the config would take)")
    i.add_argument("--ranks-per-node", type=int, default=0, metavar="K", help="simulate nodes of K ranks")
    i.add_argument("--config", help="also print the bytes per rank (computed) of training this config at this "
                                    "world size: parameters, gradients, optimizer state, activations")
    i.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one value of --config (repeatable), e.g. --set dist.zero=1")
    i.set_defaults(func=cmd_info)
    return p


def cmd_train(args) -> int:
    from .training.config import describe
    from .training.config_load import load_config
    from .errors import EXIT_CHECKPOINTED, EXIT_TARGET_MISSED
    from .reliability.fail_together import agree
    from .runtime import init_world
    from .training.trainer import Trainer

    if args.help_config:
        print(describe())
        return 0
    overrides = list(args.set)
    if args.ranks_per_node is not None:
        overrides.append(f"dist.ranks_per_node={args.ranks_per_node}")
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={json.dumps(args.resume)}")
    if args.trace is not None:
        overrides.append(f"train.trace={json.dumps(args.trace)}")
    from .reliability.signals import StopSignal

    stop = StopSignal().__enter__()  # from here on SIGUSR1/SIGTERM mean "save and stop", not death
    world = init_world()
    cfg = agree(world, load_config, args.config, overrides)
    if cfg.dist.ranks_per_node:
        world = init_world(ranks_per_node=cfg.dist.ranks_per_node)
    from .reliability import slurm
    from .training.config import CheckpointConfig

    job = slurm.current()  # inside SLURM the default checkpoint.dir is per job (runs/ckpt/<job>)
    cfg.checkpoint.dir = slurm.checkpoint_dir(cfg.checkpoint.dir, CheckpointConfig().dir)
    cfg.train.metrics = slurm.metrics_path(cfg.train.metrics)  # and its metrics (runs/mlp/<job>/metrics.jsonl)
    if world.is_root:
        print(f"resolved config ({args.config or 'defaults'}):\n{cfg.to_toml()}", flush=True)
        if job:
            print(slurm.describe(job), flush=True)
    trainer = Trainer(cfg, world, stop_signal=stop)
    code = None  # the exit code the run ends with, told to a supervising launcher by trainer.close
    try:
        result = trainer.run()
        code = EXIT_CHECKPOINTED if result["stopped_by"] else 0 if result["targets_met"] else EXIT_TARGET_MISSED
    except Exception as exc:  # the code main's error handling will exit with: a user error's, a crash's 1
        code = getattr(exc, "exit_code", 1)
        raise
    finally:
        trainer.close(code)
    stop.ignore_late()  # nothing left to stop: a late SIGUSR1/SIGTERM must not change the exit code
    return code


def cmd_sample(args) -> int:
    """Under a launcher only rank 0 samples and prints; the checkpoint is read in a child process,
    every checksum checked, and the model rebuilt on the CPU from the config stored in it."""
    import os

    import numpy as np
    from mpi4py import MPI  # every rank of a launch initialises MPI, or mpirun calls it a failure

    from .ckpt.read import load_checkpoint
    from .errors import UserError
    from .models.sample import generate, gpt_from_checkpoint
    from .runtime import init_world
    from .training.config_load import load_config_text

    if args.tokens < 0 or args.top_k < 0 or not args.temperature >= 0:
        raise UserError("sample: --tokens and --top-k must be >= 0 and --temperature >= 0 (0 = greedy)")
    if launched_rank() != 0:
        return 0  # one sample per launch, from rank 0
    if not os.path.isfile(args.checkpoint):
        raise UserError(f"--checkpoint {args.checkpoint!r}: no such file; list a run's checkpoints with "
                        f"'python -m hpctrain ckpt ls DIR'")
    loaded = load_checkpoint(args.checkpoint, init_world(MPI.COMM_SELF))  # verified; raises CorruptCheckpoint
    cfg = load_config_text(str(loaded.attrs.get("config", "")), f"{args.checkpoint} (its stored config)")
    model = gpt_from_checkpoint(loaded, cfg.model)
    prompt = np.frombuffer(args.prompt.encode("utf-8"), np.uint8)
    if len(prompt) == 0:
        raise UserError("sample: --prompt is empty; give at least one character (the default is a newline)")
    if prompt.max() >= model.vocab:
        raise UserError(f"sample: the prompt's bytes go up to {prompt.max()}, beyond the model's vocabulary of "
                        f"{model.vocab} tokens")
    out = generate(model, prompt, args.tokens, args.temperature, args.top_k, np.random.default_rng(args.seed))
    sys.stdout.write(bytes(out.astype(np.uint8)).decode("utf-8", "replace"))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _ckpt(name, args) -> int:
    from .ckpt import cli

    return getattr(cli, name)(args)


def _lazy(module, name, args) -> int:
    """Run ``hpctrain.<module>.<name>(args)``, importing the module only when asked."""
    import importlib

    return getattr(importlib.import_module(f".{module}", __package__), name)(args)


def cmd_info(args) -> int:
    from .observe.info import print_info
    from .runtime import init_world

    world = init_world(ranks_per_node=args.ranks_per_node)
    print_info(world)
    if args.config or args.set:
        from .observe.memory import describe
        from .reliability.fail_together import agree
        from .training.config_load import load_config
        from .training.plan import paper_run

        cfg = agree(world, lambda: load_config(args.config, args.set).validate())
        plan, got = agree(world, paper_run, cfg, world)  # a bad file: one error from rank 0
        if world.is_root:
            print(f"  {describe(got, cfg.dist.zero, plan.dp.size)} (rank 0 of {world.size}, "
                  f"model.kind={cfg.model.kind}, train.device={cfg.train.device}, train.dtype={cfg.train.dtype})")
            print("\n".join("  " + line for line in plan.describe().splitlines()))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"] and not {"-h", "--help"} & set(argv[1:argv.index("--") if "--" in argv else None]):
        from .reliability.launch import cmd_launch  # before the thread limits below: the ranks choose their own

        return cmd_launch(argv[1:])
    limit_threads_per_rank()  # before numpy is imported by any command
    yield_when_oversubscribed()  # before MPI_Init
    # a fatal signal (SIGSEGV in native code, SIGBUS, SIGFPE, SIGABRT, SIGILL) prints every thread's
    # Python stack before the process dies; the launcher then names the rank and the signal
    faulthandler.enable(all_threads=True)
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - every failure leaves through one door
        from .reliability.fail_together import report_and_exit

        world = _current_world()
        code = report_and_exit(exc, world, _finish_background_saves)
        _exit_now_if_hdf5_cannot_close(code, world is None or world.is_root)
        return code


def _finish_background_saves(say) -> None:
    """A run that ends by an error commits the checkpoint its ranks are writing in the background
    first (hpctrain.ckpt.background): the writers run on communicators of their own, so they finish
    while the training threads are stopped; without this the job would lose the newest save."""
    background = sys.modules.get("hpctrain.ckpt.background")
    if background is not None:
        background.finish_background_saves(say)


def _exit_now_if_hdf5_cannot_close(code: int, is_root: bool) -> None:
    """End the process at once, output flushed, when a failed checkpoint save left a file HDF5
    cannot close (hpctrain.ckpt.write.files_left_open): HDF5 closes open files again when MPI is
    finalized (and Python at exit), and that crashes in the mpio driver (SIGSEGV, measured with a
    full disk). Leaving without MPI_Finalize skips it; the launcher may add a line about that.
    Without Finalize nothing holds the silent ranks until rank 0 has printed, so they wait first."""
    write = sys.modules.get("hpctrain.ckpt.write")
    if write is None or not write.files_left_open():
        return
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    _let_rank_0_speak_first(is_root)
    os._exit(code)


def _current_world():
    """The job's world if MPI is up (for a clean abort), else None."""
    if "mpi4py.MPI" not in sys.modules:
        return None
    MPI = sys.modules["mpi4py.MPI"]
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    comm = MPI.COMM_WORLD
    # a light World: reporting and aborting need only comm, rank and size
    from .runtime import World

    return World(comm, comm.Get_rank(), comm.Get_size(), None, 0, 1, None, 0, 1)

if __name__ == "__main__":
    sys.exit(main())

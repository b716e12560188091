"""The command line as a user meets it: launches under mpirun, bad inputs, exit codes.

Each bad input must give exactly one message (from rank 0) naming the problem, and a non-zero
exit. Each way to fail runs at least once as a real `mpirun` job with a timeout: a config error
agreed at set-up (test_unknown_config_key_names_the_fix), a set-up error of the trainer
(test_cuda_device_without_a_gpu; and a global batch that 3 ranks cannot share exactly), ranks that
see different datasets, an exception on one rank (abort), a usage error before MPI is up, ranks
that leave without MPI_Finalize. The other config and set-up errors are checked in this process
(``_one_error_in_process``: the same set-up on a 1-rank world, reported by the same code, held to
the same checks as ``_one_error``).
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import types

import h5py
import numpy as np
import pytest

from conftest import REPO, run_mpi

pytestmark = pytest.mark.timeout(180)

TRAIN = ["-m", "hpctrain", "train", "--config", "examples/mlp.toml"]


def _data_set(train, eval_=""):
    return ["--set", f"data.train={train}", "--set", f"data.eval={eval_}", "--set", "train.metrics=",
            "--set", "model.hidden=[16]", "--set", "train.global_batch=64", "--set", "train.target_accuracy=0"]


def _one_error(proc, *fragments):
    """Exactly one 'hpctrain: error:' line, containing every fragment; exit code 2."""
    errors = [line for line in proc.stderr.splitlines() if "hpctrain: error:" in line]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)


def _one_error_in_process(capsys, fail, *fragments, agreed=True):
    """``fail(world)`` on a 1-rank world (COMM_SELF) must raise an error that every rank agreed on
    (raised by ``agree``: under mpirun each rank raises the same error, rank 0 alone prints it and
    every rank exits with its code), and ``report_and_exit`` -- where ``python -m hpctrain`` sends
    every failure -- must print it as ``_one_error`` wants a launch's output: exactly one
    'hpctrain: error:' line holding every fragment, no traceback, exit code 2. The real launches
    of this module (test_unknown_config_key_names_the_fix, test_cuda_device_without_a_gpu) check
    that an agreed error ends an `mpirun -n 2` job that way. ``agreed=False``: a command that runs
    as one process (``sample``), where there is no other rank to agree with. Returns
    what was printed to stderr."""
    from mpi4py import MPI

    from hpctrain.reliability.fail_together import report_and_exit
    from hpctrain.runtime import init_world

    world = init_world(MPI.COMM_SELF)
    capsys.readouterr()
    with pytest.raises(Exception) as caught, contextlib.chdir(REPO):  # relative paths as under run_mpi
        fail(world)
    assert not agreed or getattr(caught.value, "agreed", False), repr(caught.value)
    code = report_and_exit(caught.value, world)
    err = capsys.readouterr().err
    _one_error(types.SimpleNamespace(stderr=err, returncode=code), *fragments)
    return err


def _config_and_overrides(argv):
    """``python -m hpctrain train ARGV`` read by the command line's own parser: its --config and the
    overrides cmd_train makes of --set and --resume."""
    from hpctrain.__main__ import _parser

    args = _parser().parse_args(["train", *argv])
    assert args.ranks_per_node is args.trace is None, argv  # cmd_train turns them into --set; not used here
    overrides = list(args.set)
    if args.resume is not None:  # as cmd_train does
        overrides.append(f"checkpoint.resume={json.dumps(args.resume)}")
    return args.config, overrides


def _train_setup(*argv):
    """``fail`` for _one_error_in_process: what ``python -m hpctrain train ARGV`` does on every rank
    before its first step (hpctrain.__main__.cmd_train): the config loaded inside ``agree``, then
    the trainer's set-up."""
    from hpctrain.reliability.fail_together import agree
    from hpctrain.training.config_load import load_config
    from hpctrain.training.trainer import Trainer

    config, overrides = _config_and_overrides(argv)

    def fail(world):
        cfg = agree(world, load_config, config, overrides)
        Trainer(cfg, world).close()  # reached only if nothing failed: pytest.raises then fails the test
    return fail


def train_in_process(*argv):
    """The run ``python -m hpctrain train ARGV`` makes, on one rank (COMM_SELF) in this process: the
    config loaded as cmd_train loads it, the log printed to stdout as rank 0 prints it. Returns the
    trainer's result (cmd_train's exit code comes from it: 75 if stopped_by, else 0 if targets_met,
    else 3)."""
    from mpi4py import MPI

    from hpctrain.observe.log import Log
    from hpctrain.runtime import init_world
    from hpctrain.training.config_load import load_config
    from hpctrain.training.trainer import Trainer

    config, overrides = _config_and_overrides(argv)
    with contextlib.chdir(REPO):  # relative paths as under run_mpi
        trainer = Trainer(load_config(config, overrides), init_world(MPI.COMM_SELF), Log(True))
        try:
            return trainer.run()
        finally:
            trainer.close()


def hpctrain_in_process(capsys, *args):
    """``python -m hpctrain ARGS`` for a command that runs as one process (``sample``), run in this
    process by the command line's parser and the command's own function: (exit code, stdout)."""
    from hpctrain.__main__ import _parser

    capsys.readouterr()
    parsed = _parser().parse_args(list(args))
    with contextlib.chdir(REPO):
        code = parsed.func(parsed)
    return code, capsys.readouterr().out


def test_unknown_config_key_names_the_fix(small_data):
    """The real launch of a config error: every rank agrees, rank 0 prints, all exit 2."""
    proc = run_mpi(2, TRAIN + _data_set(small_data[0]) + ["--set", "train.stepz=5"])
    _one_error(proc, "unknown key train.stepz", "did you mean 'steps'")


def test_wrong_type_in_config(small_data, capsys):
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(small_data[0]), "--set", "train.steps=abc"),
                          "train.steps", "expected int")


def test_out_of_range_value(small_data, capsys):
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(small_data[0]), "--set", "optim.lr=-1"),
                          "optim.lr=-1", "must be > 0")


def test_missing_config_file(capsys):
    _one_error_in_process(capsys, _train_setup("--config", "no/such.toml"), "no/such.toml", "not found")


def test_cuda_device_without_a_gpu(small_data):
    """The real launch of a set-up error of the trainer (the other data and set-up errors are
    checked in this process: _one_error_in_process)."""
    # CUDA_VISIBLE_DEVICES="" hides any GPU, and the simulator is off: no GPU here
    proc = run_mpi(2, TRAIN + _data_set(small_data[0]) + ["--set", "train.device=cuda"],
                   env_extra={"NUMBA_ENABLE_CUDASIM": "0", "CUDA_VISIBLE_DEVICES": ""})
    _one_error(proc, "train.device='cuda' but no GPU is usable", "CUDA_VISIBLE_DEVICES=''", "'auto' or 'cpu'")


def test_missing_dataset(tmp_path, capsys):
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(str(tmp_path / "absent.h5"))),
                          "absent.h5", "not found", "hpctrain data synth")


def test_dataset_that_is_not_hdf5(tmp_path, capsys):
    bad = tmp_path / "text.h5"
    bad.write_text("not hdf5\n")
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(str(bad))), "not a readable HDF5 file")


def test_dataset_without_labels(tmp_path, capsys):
    bad = tmp_path / "nolabels.h5"
    with h5py.File(bad, "w") as f:
        f["x"] = np.zeros((128, 4), dtype=np.float32)
        f.attrs["n_classes"] = 2
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(str(bad))), "lacks dataset(s) /y")


def test_dataset_with_wrong_shape(tmp_path, capsys):
    bad = tmp_path / "flat.h5"
    with h5py.File(bad, "w") as f:
        f["x"] = np.zeros(128, dtype=np.float32)
        f["y"] = np.zeros(128, dtype=np.int64)
        f.attrs["n_classes"] = 2
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(str(bad))), "/x must be a 2-D float array")


def test_global_batch_not_divisible_by_world_size_with_exact_shares(small_data):
    proc = run_mpi(3, TRAIN + _data_set(small_data[0]) + ["--set", "train.global_batch=64",
                                                            "--set", "train.exact_shares=true"])
    _one_error(proc, "global_batch=64 is not divisible by the world size 3", "63", "66")


def test_uneven_shares_are_named_at_start_up(small_data):
    proc = run_mpi(3, TRAIN + _data_set(small_data[0]) + ["--set", "train.global_batch=64", "--set", "train.steps=2"])
    assert proc.returncode == 0, proc.stderr
    assert "global batch 64 = 22 x 1 + 21 x 2 (uneven shares, gradients weighted by share)" in proc.stdout


def test_dataset_smaller_than_one_global_batch(small_data, capsys):
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(small_data[0]),
                                               "--set", "train.global_batch=4096"), "fewer than one global batch")


def test_exception_on_one_rank_aborts_every_rank():
    """Rank 1 fails while rank 0 waits in a collective: the job must end, not hang."""
    code = ("from hpctrain.runtime import init_world\n"
            "from hpctrain.reliability.fail_together import report_and_exit\n"
            "w = init_world()\n"
            "try:\n"
            "    if w.rank == 1: raise RuntimeError('boom on one rank')\n"
            "    w.comm.Barrier()\n"
            "except Exception as e:\n"
            "    report_and_exit(e, w)\n")
    proc = run_mpi(2, ["-c", code], timeout=60)
    assert proc.returncode != 0
    assert "[rank 1] RuntimeError: boom on one rank" in proc.stderr
    assert proc.stderr.count("boom on one rank") == 1


def test_missed_accuracy_target_exits_3(small_data):
    proc = run_mpi(2, TRAIN + _data_set(*small_data) + ["--set", "train.steps=1",
                                                         "--set", "train.target_accuracy=0.999"])
    assert proc.returncode == 3, proc.stderr
    assert "NOT reached" in proc.stdout


def test_runs_without_a_launcher_as_one_rank(small_data, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, *TRAIN, *_data_set(*small_data), "--set", "train.steps=20",
                           "--set", f"train.metrics={metrics}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 rank(s) on 1 node(s)" in proc.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    for key in ("loss", "accuracy", "lr", "step_time", "comm_time", "exposed_comm_time", "bytes_reduced",
                "allreduce", "samples_per_s"):
        assert all(key in r for r in records)


def test_progress_line_and_resolved_config_printed_once(small_data):
    proc = run_mpi(2, TRAIN + _data_set(*small_data) + ["--set", "train.steps=20", "--set", "train.log_every=10"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("resolved config") == 1
    lines = [l for l in proc.stdout.splitlines() if l.startswith("step ")]
    assert len(lines) == 2  # non-TTY under mpirun: one plain line per log_every steps
    assert re.search(r"step +20/20 \| loss [\d.]+ \| acc +[\d.]+% \| [\d,]+ samples/s \| lr \S+ \| ETA \d:\d\d:\d\d",
                     lines[-1]), lines[-1]


def test_info_shows_every_rank_and_simulated_nodes():
    proc = run_mpi(2, ["-m", "hpctrain", "info", "--ranks-per-node", "1"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "2 rank(s), 2 node(s)" in proc.stdout
    assert "MPI thread level  multiple" in proc.stdout
    assert "mpi=True" in proc.stdout  # h5py built against parallel HDF5
    rows = [l.split() for l in proc.stdout.splitlines() if re.match(r"\s+\d+\s", l)]
    assert [(r[0], r[4]) for r in rows] == [("0", "0/2"), ("1", "1/2")]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to bind 2 ranks to one each")
def test_info_reports_each_ranks_binding_and_says_when_its_threads_outnumber_its_cores():
    """mpirun -n 2 bound to a core each, with 2 threads asked for: each row shows one CPU and 2 op
    threads, and the table is followed by the warning naming both ranks."""
    proc = run_mpi(2, ["-m", "hpctrain", "info"], timeout=60,
                   env_extra={"OMPI_MCA_hwloc_base_binding_policy": "core", "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr
    rows = [l for l in proc.stdout.splitlines() if re.match(r"\s+\d+\s", l)]
    assert len(rows) == 2 and all(re.search(r"\s\d+ \(1\)\s+2/", r) for r in rows), proc.stdout
    assert "threads: rank(s) 0,1: this rank is bound to 1 core(s)" in proc.stdout, proc.stdout


def test_info_at_one_unbound_rank_shows_every_core_and_no_warning():
    cores = len(os.sched_getaffinity(0))
    share = {var: str(cores) for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                         "NUMBA_NUM_THREADS")}
    proc = run_mpi(1, ["-m", "hpctrain", "info"], timeout=60,
                   env_extra={"OMPI_MCA_hwloc_base_binding_policy": "none", **share})
    assert proc.returncode == 0, proc.stderr
    row = [l for l in proc.stdout.splitlines() if re.match(r"\s+0\s", l)][0]
    assert re.search(rf"\s[\d,-]+ \({cores}\)\s+{cores}/{cores}/{cores}\s", row), row
    assert "threads: rank(s)" not in proc.stdout


def test_cpu_lists_and_the_oversubscription_note():
    from hpctrain.runtime import cpu_list, oversubscribed_note

    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and cpu_list({3}) == "3"
    bound = {"cores": 2, "cpus": "0-1", "ops": 2, "blas": 2, "numba": "2"}
    assert oversubscribed_note(bound) is None
    note = oversubscribed_note(dict(bound, blas="4"))
    assert note.startswith("this rank is bound to 2 core(s) (CPUs 0-1) but runs 4 threads") and "PE=4" in note


def test_info_with_a_config_prints_its_memory_per_rank(text_data, capsys):
    """info --config: the bytes per rank at this world size, one line from rank 0; a bad value is one error
    (agreed by every rank: checked on info's own code in this process, as _one_error_in_process says)."""
    from hpctrain.__main__ import _parser, cmd_info

    args = ["-m", "hpctrain", "info", "--config", "examples/gpt.toml", "--set", f"data.train={text_data}",
            "--set", "dist.allreduce=ring", "--set", "dist.zero=1"]
    proc = run_mpi(2, args, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if "memory per rank (computed)" in l]
    assert len(lines) == 1 and "optimizer state" in lines[0] and "(zero 1: a 1/2 share)" in lines[0], proc.stdout
    assert "(rank 0 of 2, model.kind=gpt" in lines[0]
    bad = _parser().parse_args(args[2:] + ["--set", "dist.zero=5"])
    _one_error_in_process(capsys, lambda world: cmd_info(bad), "hpctrain: error: dist.zero=5")


def test_help_and_help_config():
    out = subprocess.run([sys.executable, "-m", "hpctrain", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "info" in out.stdout
    out = subprocess.run([sys.executable, "-m", "hpctrain", "train", "--help-config"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "global_batch" in out.stdout and "# " in out.stdout


def test_importing_hpctrain_starts_no_mpi():
    code = ("import sys, hpctrain, hpctrain.training.trainer, hpctrain.runtime, hpctrain.comm, hpctrain.__main__, "
            "hpctrain.device, hpctrain.kernels.linear, hpctrain.comm.staging\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI initialised at import'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_labels_out_of_range(tmp_path, capsys):
    bad = tmp_path / "onebased.h5"
    with h5py.File(bad, "w") as f:
        f["x"] = np.zeros((128, 4), dtype=np.float32)
        f["y"] = np.arange(128) % 4 + 1  # 1-based labels with n_classes = 4
        f.attrs["n_classes"] = 4
    _one_error_in_process(capsys, _train_setup(*TRAIN[3:], *_data_set(str(bad))), "labels span [1, 4]", "n_classes=4")


def test_unwritable_metrics_path(small_data, tmp_path):
    """A set-up error on one rank only (rank 0 alone opens the metrics file): the other rank joins
    the agreement, so the job still prints one error, naming the rank, and every rank exits 2.
    The real launch of that mechanism."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_mpi(2, TRAIN + _data_set(small_data[0]) + ["--set", f"train.metrics={blocker}/m.jsonl"])
    _one_error(proc, "on rank 0:", "train.metrics", "cannot be written")


def test_metrics_are_appended_only_by_a_run_that_resumed(small_data, tmp_path, capsys):
    """--resume auto with no checkpoint is a fresh start: it must not append to an older run's
    metrics (seen: a second "step": 1 in the middle of the file); a real resume continues them.
    (The two 1-rank runs run in this process: train_in_process.)"""
    import json

    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ck"
    metrics.write_text('{"step": 1, "from": "an older run"}\n')
    run = TRAIN[3:] + _data_set(small_data[0]) + ["--set", f"train.metrics={metrics}", "--set",
                                                 f"checkpoint.dir={ckpt}", "--set", "train.log_every=1",
                                                 "--resume", "auto"]
    first = train_in_process(*run, "--set", "train.steps=3", "--set", "checkpoint.save_final=true")
    assert first["stopped_by"] is None and first["targets_met"], first  # exit code 0
    steps = [json.loads(line).get("step") for line in metrics.read_text().splitlines()]
    assert "an older run" not in metrics.read_text() and steps[0] == 1, steps
    capsys.readouterr()
    second = train_in_process(*run, "--set", "train.steps=5")
    assert second["stopped_by"] is None and second["targets_met"], second  # exit code 0
    out = capsys.readouterr()
    assert "resumed from" in out.out + out.err
    after = [json.loads(line).get("step") for line in metrics.read_text().splitlines()]
    assert after[:len(steps)] == steps and [s for s in after[len(steps):] if s is not None][:2] == [4, 5], after


def test_usage_error_printed_once():
    proc = run_mpi(3, ["-m", "hpctrain", "train", "--ranks-per-node", "two"], timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("hpctrain: error:") == 1, proc.stderr
    assert proc.stderr.count("usage:") == 1


def test_usage_error_printed_even_when_rank_0_is_last_to_parse():
    """mpirun ends the job at the first non-zero exit: the silent ranks must not leave before rank 0 printed."""
    code = ("import os, sys, time\n"
            "os.environ['OMPI_COMM_WORLD_RANK'] == '0' and time.sleep(1.5)\n"
            "from hpctrain.__main__ import main\n"
            "sys.exit(main(['train', '--ranks-per-node', 'two']))\n")
    _one_error(run_mpi(3, ["-c", code], timeout=60), "argument --ranks-per-node")


def test_error_printed_when_ranks_leave_without_finalize():
    """A save that left a file HDF5 cannot close ends every rank with os._exit (no MPI_Finalize to
    hold the silent ranks); rank 0's message must still come out, even when writing it is slow.
    3 s: longer than mpirun's wait from SIGTERM (which hpctrain catches, to checkpoint) to SIGKILL."""
    code = ("import os, sys, time\n"
            "from hpctrain.ckpt import write\n"
            "write.LEFT_OPEN.append(object())   # as after a failed close of a checkpoint file\n"
            "class Slow:\n"
            "    def __init__(self, f): self.f = f\n"
            "    def write(self, text):\n"
            "        'hpctrain: error' in text and time.sleep(3)\n"
            "        return self.f.write(text)\n"
            "    def __getattr__(self, name): return getattr(self.f, name)\n"
            "if os.environ['OMPI_COMM_WORLD_RANK'] == '0': sys.stderr = Slow(sys.stderr)\n"
            "from hpctrain.__main__ import main\n"
            "sys.exit(main(['train', '--set', 'bad.key=1']))\n")
    _one_error(run_mpi(3, ["-c", code], timeout=60), "--set bad.key=1: unknown section [bad]")


def test_ranks_seeing_different_datasets(small_data, tmp_path):
    """A node-local copy that differs: rank 1 reads a file with other N and D."""
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.zeros((4096, 3), dtype=np.float32)
        f["y"] = np.zeros(4096, dtype=np.int64)
        f.attrs["n_classes"] = 4
    link = tmp_path / "rank-data.h5"
    code = ("import os, sys\n"
            f"r = int(os.environ['OMPI_COMM_WORLD_RANK']); p = {str(link)!r} + str(r)\n"
            f"os.path.exists(p) or os.symlink({small_data[0]!r} if r == 0 else {str(other)!r}, p)\n"
            "from hpctrain.__main__ import main\n"
            f"sys.exit(main(sys.argv[1:] + ['--set', 'data.train=' + p]))\n")
    proc = run_mpi(2, ["-c", code, *TRAIN[2:], *_data_set("x")[2:]])
    _one_error(proc, "ranks see different datasets", "rank 0: N=2048 D=8", "rank 1: N=4096 D=3")

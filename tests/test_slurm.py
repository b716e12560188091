"""The jobs/ templates and srun on a real (local) SLURM cluster: nodes n1 and n2 on this host.

The cluster (tests/slurm_cluster.py) is started once and always stopped. Every
wait has a timeout after which the job is cancelled. Single-node jobs use Open
MPI's defaults; jobs over both simulated nodes use TCP on lo (the nodes share a
hostname, so shared memory would collide between them).
"""

import json
import os
import re
import shlex
import shutil
import sys
import time

import numpy as np
import pytest

from conftest import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.exclusive]  # one cluster; time limits
JOBS = os.path.join(REPO, "jobs")


def _small_args(train: str, steps: int, *extra: str) -> list[str]:
    """hpctrain train arguments for the small test set: no eval, no metrics, no accuracy target."""
    return ["--config", os.path.join(REPO, "examples", "mlp.toml"), "--set", f"data.train={train}",
            "--set", "data.eval=", "--set", "train.metrics=", "--set", "train.target_accuracy=0",
            "--set", f"train.steps={steps}", "--set", "train.log_every=1000000", *extra]


def _read(path) -> str:
    with open(path, errors="replace") as fh:
        return fh.read()


@pytest.mark.timeout(660)
def test_train_sbatch_unmodified_trains_the_example(slurm_cluster, tmp_path):
    """`sbatch jobs/train.sbatch` as shipped: the example MLP, its data made by the job, 4 ranks on n1."""
    os.makedirs(tmp_path / "examples")
    shutil.copy(os.path.join(REPO, "examples", "mlp.toml"), tmp_path / "examples")
    out = tmp_path / "train.out"
    job = slurm_cluster.sbatch([f"--output={out}", os.path.join(JOBS, "train.sbatch")], cwd=tmp_path)
    (record,) = slurm_cluster.wait(job, 600, str(out))
    text = _read(out)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert f"slurm: job {job} (hpctrain), 1 node(s) n1" in text and "4 rank(s) on 1 node(s)" in text, text
    accuracy = float(re.search(r"final eval accuracy ([\d.]+)%", text).group(1))
    assert accuracy >= 90.0 and "step   1500/1500" in text, text
    # inside SLURM the default checkpoint directory is per job
    assert os.path.isdir(tmp_path / "runs" / "ckpt" / job)


@pytest.mark.timeout(300)
def test_train_sbatch_trains_the_gpt_a_config_away(slurm_cluster, text_data, tmp_path):
    """`sbatch jobs/train.sbatch --config examples/gpt.toml` (made small with --set): srun starts the GPT
    on 2 ranks, it evaluates and saves into the job's checkpoint directory."""
    out = tmp_path / "gpt.out"
    # dist.allreduce=mpi: the example's auto measures every algorithm first (seconds), not this test's matter
    sets = {"data.train": text_data, "model.n_layer": 2, "model.d_model": 16, "model.context": 16,
            "train.global_batch": 8, "train.steps": 10, "train.eval_tokens": 512, "train.target_bpb_vs_bigram": 0,
            "train.metrics": "", "checkpoint.every_minutes": 0, "dist.allreduce": "mpi"}
    args = ["--config", os.path.join(REPO, "examples", "gpt.toml"),
            *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]
    job = slurm_cluster.sbatch(["-n", "2", f"--output={out}", os.path.join(JOBS, "train.sbatch"), *args],
                               cwd=tmp_path)
    (record,) = slurm_cluster.wait(job, 240, str(out))
    text = _read(out)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "2 rank(s) on 1 node(s)" in text and "tokens/s" in text and "final eval loss" in text, text
    assert os.path.isfile(tmp_path / "runs" / "gpt" / "ckpt" / "ckpt-00000010.h5"), text


@pytest.mark.timeout(420)
def test_srun_two_nodes_hierarchical(slurm_cluster, small_data, tmp_path):
    """`srun -N 2 -n 4`: ranks on both nodes (3 + 1: block distribution), hierarchical sees 2 nodes."""
    env = slurm_cluster.env(two_nodes=True)
    srun = ["srun", "-N", "2", "-n", "4", sys.executable, "-m", "hpctrain"]
    info = slurm_cluster.run([*srun, "info"], timeout=180, env=env, cwd=tmp_path)
    assert info.returncode == 0, info.stdout + info.stderr
    assert "4 rank(s), 2 node(s)" in info.stdout, info.stdout
    lines = info.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "host"])
    starts = [m.start() for m in re.finditer(r"\S+", lines[header])]  # columns are padded (values have spaces)
    cols = lines[header].split()
    rows = [{c: line[a:b].strip() for c, a, b in zip(cols, starts, starts[1:] + [None])}
            for line in lines[header + 1:header + 5]]
    assert sorted(r["slurm_node"] for r in rows) == ["n1", "n1", "n1", "n2"], info.stdout
    assert {r["node"] for r in rows} == {"0/2", "1/2"}, info.stdout

    train = slurm_cluster.run([*srun, "train", *_small_args(small_data[0], 10, "--set", "dist.allreduce=hierarchical",
                                                               "--set", f"checkpoint.dir={tmp_path / 'ckpt'}")],
                              timeout=300, env=env, cwd=tmp_path)
    assert train.returncode == 0, train.stdout + train.stderr
    assert "4 rank(s) on 2 node(s)" in train.stdout and "allreduce hierarchical" in train.stdout, train.stdout
    assert "done: 10 steps" in train.stdout and "slurm: job" in train.stdout, train.stdout


REQUEUE_SETS = ["--set", "checkpoint.every_minutes=0", "--set", "checkpoint.save_final=true"]
# --time=2 --signal=B:USR1@80: slurmctld looks at time limits every 30 s (PERIODIC_TIMEOUT, compiled in)
# and sends the warning at its first look within 80 + 30 s of the limit, so 10-40 s after each start.
# The job must outlast it: 120 steps paced at 0.5 s each (HPCTRAIN_STEP_DELAY_S, a sleep before every
# step: the arithmetic is unchanged) train for 60 s after start-up on any machine. Paced only until
# the signal made a checkpoint: a start that resumes one runs unpaced (_python_paced_until_saved) and
# is over in seconds, so the test waits for one signal, not for the pacing (a resumed start that still
# meets a signal, on a loaded machine, is requeued once more). The uninterrupted reference runs unpaced.
REQUEUE_STEPS, REQUEUE_STEP_DELAY_S, REQUEUE_SIGNAL = 120, 0.5, "B:USR1@80"
# the last line of one start of requeue.sbatch
REQUEUE_START_ENDED = re.compile(r"^requeue\.sbatch: (training finished|training failed|the launcher gave up|"
                                 r"checkpoint saved)", re.M)


def _python_paced_until_saved(folder) -> str:
    """An HPCTRAIN_PYTHON that runs hpctrain with HPCTRAIN_STEP_DELAY_S=0 once the job has a checkpoint
    (requeue.sbatch works in HPCTRAIN_HOME; the job's checkpoints go to runs/ckpt/<job id>)."""
    path = os.path.join(folder, "python")
    with open(path, "w") as fh:
        fh.write('#!/bin/sh\n'
                 'ls runs/ckpt/"$SLURM_JOB_ID"/ckpt-*.h5 >/dev/null 2>&1 && export HPCTRAIN_STEP_DELAY_S=0\n'
                 f'exec {shlex.quote(sys.executable)} "$@"\n')
    os.chmod(path, 0o755)
    return path


def _datasets(path: str) -> dict:
    import h5py

    out = {}
    with h5py.File(path, "r") as fh:
        fh.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.timeout(900)
def test_requeue_template_survives_its_time_limit(slurm_cluster, small_data, tmp_path):
    """requeue.sbatch with a 2-minute limit: SIGUSR1 before the limit, checkpoint, requeue, resume, finish;
    the final state equals an uninterrupted run's, bit for bit."""
    from mpi_jobs import wait_for

    env = slurm_cluster.env(HPCTRAIN_HOME=str(tmp_path), HPCTRAIN_MAX_RESTARTS="8")
    steps = REQUEUE_STEPS
    args = _small_args(small_data[0], steps, *REQUEUE_SETS)
    out = tmp_path / "requeue.out"
    paced = dict(env, HPCTRAIN_STEP_DELAY_S=str(REQUEUE_STEP_DELAY_S),
                 HPCTRAIN_PYTHON=_python_paced_until_saved(tmp_path))
    job = slurm_cluster.sbatch(["--time=2", f"--signal={REQUEUE_SIGNAL}", "--ntasks-per-node=2", f"--output={out}",
                                os.path.join(JOBS, "requeue.sbatch"), *args], env=paced, cwd=tmp_path)

    # the same run without interruption (same launcher, same 2 ranks), unpaced; while the job waits
    # out its requeue (AuthInfo=cred_expire), or after it ended without one
    try:
        wait_for(lambda: out.exists() and REQUEUE_START_ENDED.search(_read(out)), 300,
                 f"the end of the job's first start in {out}")
    except AssertionError:
        slurm_cluster.run(["scancel", job], timeout=15)
        raise
    srun = ["srun", "-n", "2", sys.executable, "-m", "hpctrain", "train"]
    ref = slurm_cluster.run([*srun, *args, "--set", f"checkpoint.dir={tmp_path / 'ref'}"], timeout=600, env=env,
                            cwd=tmp_path)

    (record,) = slurm_cluster.wait(job, 600, str(out))
    text = _read(out)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), text
    print(f"\nrequeue test: {steps} steps; scontrol: "
          + " ".join(f"{k}={record[k]}" for k in ("JobId", "JobState", "Restarts", "ExitCode", "RunTime", "TimeLimit")))
    print("jobcomp (the sacct records of the starts):\n" + "\n".join(slurm_cluster.jobcomp(job)))
    print("\n".join(line for line in text.splitlines() if line.startswith(("requeue.sbatch", "checkpoint", "stopping"))))
    restarts = int(record["Restarts"])
    assert restarts >= 1, f"never requeued (training too fast for the signal?)\n{text}"
    assert text.count("got SIGUSR1") >= restarts and text.count(f"requeueing job {job}") == restarts, text
    assert len(re.findall(rf"resumed from runs/ckpt/{job}/ckpt-\d+\.h5", text)) >= 1, text
    assert f"training finished after {restarts} restart(s)" in text, text

    assert ref.returncode == 0, ref.stdout + ref.stderr
    final = f"ckpt-{steps:08d}.h5"
    got, want = _datasets(str(tmp_path / "runs" / "ckpt" / job / final)), _datasets(str(tmp_path / "ref" / final))
    assert sorted(got) == sorted(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name} differs from the uninterrupted run"


# --allreduce mpi: auto would measure every algorithm at the first 2-rank run (seconds), not these tests' matter
SCALING_TINY = ["--models", "tiny=8-16", "--steps", "3", "--warmup", "1", "--samples", "2048", "--batch", "32",
                "--peer-models", "", "--trace-config", "", "--allreduce", "mpi"]


def _scaling_rows(doc) -> list:
    return sorted((r["trainer"], r["mode"], r["ranks"], r["global_batch"], r["rc"]) for r in doc["rows"])


@pytest.mark.timeout(420)
def test_scaling_sbatch_runs_the_benchmark_with_srun(slurm_cluster, tmp_path):
    """scaling.sbatch as one job over rank counts 1 and 2: benchmarks/scaling.py, each run an srun step."""
    env = slurm_cluster.env(HPCTRAIN_HOME=REPO, HPCTRAIN_RANK_COUNTS="1 2", HPCTRAIN_OUT=str(tmp_path / "res"))
    out = tmp_path / "scaling.out"
    job = slurm_cluster.sbatch([f"--output={out}", os.path.join(JOBS, "scaling.sbatch"), *SCALING_TINY],
                               env=env, cwd=tmp_path)
    (record,) = slurm_cluster.wait(job, 360, str(out))
    text = _read(out)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), text
    with open(tmp_path / "res" / "scaling.json") as fh:
        doc = json.load(fh)
    assert _scaling_rows(doc) == [("hpctrain", "strong", 1, 64, 0), ("hpctrain", "strong", 2, 64, 0),
                                  ("hpctrain", "weak", 1, 32, 0), ("hpctrain", "weak", 2, 64, 0),
                                  ("independent", "weak", 1, 32, 0), ("independent", "weak", 2, 64, 0)]
    assert doc["args"]["launcher"].startswith("srun -n {n}")
    log = _read(tmp_path / "res" / "runs" / "hpctrain-tiny-weak-n2.log")
    assert log.startswith("$ srun -n 2") and "2 rank(s) on 1 node(s)" in log
    assert "## Weak scaling against the machine's ceiling" in text and (tmp_path / "res" / "scaling.md").exists()


@pytest.mark.timeout(420)
def test_scaling_array_joins_one_result_per_task(slurm_cluster, tmp_path):
    """scaling.sbatch as a 2-task array over rank counts 1 and 2: one scaling.json per task, and the
    joined report of both (the same strong-scaling batch in both tasks, so one series)."""
    env = slurm_cluster.env(HPCTRAIN_HOME=REPO, HPCTRAIN_RANK_COUNTS="1 2", HPCTRAIN_OUT=str(tmp_path / "res"))
    job = slurm_cluster.sbatch(["--array=0-1", f"--output={tmp_path}/%x-%A_%a.out", os.path.join(JOBS, "scaling.sbatch"),
                                *SCALING_TINY, "--modes", "strong"], env=env, cwd=tmp_path)
    records = slurm_cluster.wait(job, 360, str(tmp_path / f"hpctrain-scaling-{job}_0.out"))
    assert sorted(r.get("ArrayTaskId") for r in records) == ["0", "1"]
    assert all((r["JobState"], r["ExitCode"]) == ("COMPLETED", "0:0") for r in records), records
    for ranks in (1, 2):
        with open(tmp_path / "res" / f"ranks-{ranks}" / "scaling.json") as fh:
            assert _scaling_rows(json.load(fh)) == [("hpctrain", "strong", ranks, 64, 0)]
    table = _read(tmp_path / "res" / "scaling.md")
    rows = [line for line in table.splitlines() if line.startswith("| tiny | hpctrain |")]
    assert [line.split(" | ")[2] for line in rows] == ["1", "2"], table
    assert rows[1].split(" | ")[-2].endswith("x") and rows[1].split(" | ")[-2] != "-x", table  # a speedup


@pytest.mark.timeout(300)
def test_allreduce_sbatch_across_two_nodes(slurm_cluster, tmp_path):
    """allreduce.sbatch over n1 and n2 (one rank each), tiny sizes: validated and timed."""
    env = slurm_cluster.env(two_nodes=True, HPCTRAIN_HOME=REPO, HPCTRAIN_OUT=str(tmp_path / "allreduce.json"))
    out = tmp_path / "allreduce.out"
    job = slurm_cluster.sbatch(["--ntasks-per-node=1", f"--output={out}", os.path.join(JOBS, "allreduce.sbatch"),
                                "--max", "16K", "--strategies", "hierarchical,ring", "--iters", "3", "--warmup", "1"],
                               env=env, cwd=tmp_path)
    (record,) = slurm_cluster.wait(job, 240, str(out))
    text = _read(out)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "2 ranks on 2 node(s)" in text or "n_nodes=2" in text, text
    with open(tmp_path / "allreduce.json") as fh:
        assert json.load(fh)


@pytest.mark.timeout(300)
def test_kill_9_of_one_rank_ends_the_train_sbatch_job(slurm_cluster, small_data, tmp_path):
    """train.sbatch with 3 ranks; one rank is killed with SIGKILL mid-training: srun --kill-on-bad-exit
    ends the others, and the job is FAILED well within 60 s instead of hanging in a collective."""
    from mpi_jobs import alive, metrics_steps, rank_pids, wait_for

    marker = str(tmp_path / "ck-slurm-kill")
    metrics = tmp_path / "metrics.jsonl"
    out = tmp_path / "kill.out"
    args = _small_args(small_data[0], 1_000_000, "--set", f"checkpoint.dir={marker}", "--set",
                       f"train.metrics={metrics}", "--set", "train.global_batch=63", "--set", "model.hidden=[64]")
    job = slurm_cluster.sbatch(["-n", "3", f"--output={out}", os.path.join(JOBS, "train.sbatch"), *args],
                               env=slurm_cluster.env(HPCTRAIN_HOME=REPO), cwd=tmp_path)
    try:
        wait_for(lambda: metrics_steps(metrics) >= 20, 180, "20 training steps")
        pids = rank_pids(marker)
        assert len(pids) == 3, pids
        os.kill(pids[-1], 9)
        t0 = time.monotonic()
        (record,) = slurm_cluster.wait(job, 60, str(out))
        took = time.monotonic() - t0
    finally:
        slurm_cluster.run(["scancel", job], timeout=15)
    wait_for(lambda: not alive(pids), 10, "every rank to be gone")
    assert record["JobState"] == "FAILED" and record["ExitCode"] != "0:0", (record, _read(out)[-3000:])
    print(f"\nslurm kill -9: job {job} {record['JobState']} {record['ExitCode']} {took:.1f} s after the kill")


def _slurm_rank_pid(marker: str, rank: int):
    """Pid of srun task ``rank`` (SLURM_PROCID) among the rank processes holding ``marker``."""
    from mpi_jobs import rank_pids

    for pid in rank_pids(marker):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if f"SLURM_PROCID={rank}".encode() in fh.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    return None


@pytest.mark.timeout(600)
def test_requeue_template_restarts_after_a_crash_and_on_the_nodes_left_after_a_node_is_lost(
        slurm_cluster, small_data, tmp_path):
    """requeue.sbatch on 2 nodes x 2 ranks: kill -9 of one rank restarts training on both nodes;
    then node n2 crashes (its slurmd, slurmstepd and ranks killed at once) in the middle of the save
    of step 150 (held open 5 s), with SLURM's default SlurmdTimeout (300 s) and dist.comm_timeout's
    (300 s): the launcher hears n2's ranks fall silent (heartbeats, HPCTRAIN_DETECT_S's default of
    5 s), ends the step, leaves n2 out without probing it and restarts on n1 alone with 2 ranks
    (63 rows: uneven shares), the first new step within 30 s of the crash, and the job finishes.
    (The watchdog's way of ending ranks stuck in a save with a rank gone is tests/test_faults.py's.)
    Each restart's work equals a plain resume from the checkpoint it loaded, at its world size, bit
    for bit: the first restart's checkpoints against 4 ranks on both nodes, the final state against
    2 ranks on n1."""
    from mpi_jobs import wait_for

    script = os.path.join(REPO, "scripts", "slurm-cluster.sh")
    # a checkpoint every 50 steps: the rank is killed after the one of step 50 (the restart resumes
    # there), the node in the save of step 150 (100 steps on: the killed run cannot reach it); the
    # restart on n1 resumes at 100 and trains past the crash to the end
    ck, out, steps, killed_after, lost_in = tmp_path / "ck", tmp_path / "resilient.out", 200, 50, 150
    env = slurm_cluster.env(two_nodes=True, HPCTRAIN_HOME=REPO)
    hold_save = dict(HPCTRAIN_CKPT_WRITE_DELAY_S="5", HPCTRAIN_CKPT_DELAY_STEP=str(lost_in))
    args = _small_args(small_data[0], steps, "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every_steps=50",
                       "--set", "checkpoint.every_minutes=0", "--set", "checkpoint.keep_last=0",
                       "--set", "checkpoint.save_final=true", "--set", "train.global_batch=63",
                       "--set", "model.hidden=[64]", "--set", "train.dtype=float64")
    job = slurm_cluster.sbatch(["-N", "2", "--ntasks-per-node=2", f"--output={out}",
                                os.path.join(JOBS, "requeue.sbatch"), *args], env=dict(env, **hold_save),
                               cwd=tmp_path)
    try:
        wait_for(lambda: (ck / f"ckpt-{killed_after:08d}.h5").exists(), 240,
                 f"the checkpoint of step {killed_after}")
        os.kill(_slurm_rank_pid(str(ck), 1), 9)  # a rank on n1
        wait_for(lambda: "recovered: first new step" in _read(out), 120, "the first restart's first step")
        wait_for(lambda: (ck / f".ckpt-{lost_in:08d}.h5.tmp").exists(), 120, f"the save of step {lost_in}")
        lost = slurm_cluster.run(["bash", script, "lose-node", slurm_cluster.root, "n2"], timeout=30)
        t_lost = time.time()
        assert lost.returncode == 0, lost.stdout + lost.stderr
        wait_for(lambda: _read(out).count("recovered: first new step") >= 2, 120, "the second restart's first step")
        t_recovered = time.time()
        # the script ends, but the job stays COMPLETING until every node of it answers: n2 comes back first
        try:
            wait_for(lambda: REQUEUE_START_ENDED.search(_read(out)), 240, "the end of the batch script")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its output so far:\n{_read(out)[-6000:]}") from None
    finally:
        back = slurm_cluster.run(["bash", script, "revive-node", slurm_cluster.root, "n2"], timeout=60)
    (record,) = slurm_cluster.wait(job, 60, str(out))
    text = _read(out)
    print("\n".join(line for line in text.splitlines() if line.startswith(("hpctrain launch", "requeue.sbatch"))))
    assert back.returncode == 0, back.stdout + back.stderr
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert "failure 1: exit code" in text and "restart 1 of at most 3: 4 rank(s) on 2 node(s) n1,n2" in text, text
    assert "failure 2: node(s) n2 stopped answering (rank(s) 2, 3 silent for" in text, text
    assert "node n2 is not usable: its ranks stopped answering (no heartbeat)" in text, text
    assert "restart 2 of at most 3: 2 rank(s) on 1 node(s) n1 (1 of 2 lost)" in text, text
    assert text.count("recovered: first new step") == 2, text
    assert "hpctrain 0.1.0: 2 rank(s) on 1 node(s)" in text and "global batch 63 = 32 x 1 + 31 x 1" in text, text
    assert re.search(r"slurm: job \d+ .*1 node\(s\) n1\b", text), text  # the restart's own nodes
    second = re.findall(r"recovered: first new step ([\d.]+) s after the failure \(detection ([\d.]+) s, tear-down "
                        r"[\d.]+ s, node probes [\d.]+ s, start-up [\d.]+ s, checkpoint load and set-up [\d.]+ s, "
                        r"first step [\d.]+ s\)", text)
    assert len(second) == 1, text
    total, detection = (float(v) for v in second[0])
    assert detection < 10.0 and total < 30.0, text  # the default limit of 5 s, one beat and a poll
    assert t_recovered - t_lost < 30.0 + 2.0, (t_recovered - t_lost, text)  # by this test's own clock
    print(f"\nnode lost: detection {detection:.1f} s, first new step {total:.1f} s after the failure "
          f"(this test saw it {t_recovered - t_lost:.1f} s after the crash)")
    assert "training finished after 0 restart(s)" in text, text  # no requeue: the failures stayed inside

    # each restart from its checkpoint again, without failures (and no save held open), at its world size
    first, last = (int(s) for s in re.findall(r"recovered: .*resumed at step (\d+)", text))
    for name, resumed, srun, compare in (("ref4", first, ["-N", "2", "-n", "4"], f"ckpt-{last:08d}.h5"),
                                         ("ref2", last, ["-N", "1", "-n", "2", "-w", "n1"], f"ckpt-{steps:08d}.h5")):
        ref = tmp_path / name
        ref.mkdir()
        shutil.copy(ck / f"ckpt-{resumed:08d}.h5", ref)
        again = slurm_cluster.run(["srun", *srun, sys.executable, "-m", "hpctrain", "train", *args,
                                   "--set", f"checkpoint.dir={ref}", "--resume", "auto"],
                                  timeout=300, env=env, cwd=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        got, want = _datasets(str(ck / compare)), _datasets(str(ref / compare))
        assert sorted(got) == sorted(want)
        for key in want:
            assert np.array_equal(got[key], want[key]), f"{compare}: {key} differs from a plain resume ({name})"


@pytest.mark.timeout(300)
def test_requeue_template_gives_up_after_more_failures_than_allowed(slurm_cluster, small_data, tmp_path):
    """A rank that crashes (SIGSEGV) at step 5, HPCTRAIN_MAX_FAILURES=0: the launcher gives up with one
    error line instead of restarting, the script does not requeue, the job is FAILED with exit code 6.
    (How many restarts come first is the launcher's policy, tested with mpirun in test_launch.py.)"""
    out = tmp_path / "giveup.out"
    env = slurm_cluster.env(HPCTRAIN_HOME=REPO, HPCTRAIN_MAX_FAILURES="0", HPCTRAIN_FAULT="segv:5:1")
    args = _small_args(small_data[0], 100, "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set",
                       "model.hidden=[16]")
    job = slurm_cluster.sbatch(["-n", "2", f"--output={out}", os.path.join(JOBS, "requeue.sbatch"), *args],
                               env=env, cwd=tmp_path)
    (record,) = slurm_cluster.wait(job, 240, str(out))
    text = _read(out)
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "6:0"), text[-3000:]
    assert "failure 1: " in text and "restart 1" not in text, text
    assert text.count("hpctrain launch: error: giving up: 1 failure(s), more than --max-failures=0") == 1, text
    assert "the launcher gave up after repeated failures" in text and "requeueing job" not in text, text

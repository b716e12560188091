"""hpctrain.reliability.slurm without a cluster: what a job's environment says, the per-job checkpoint
directory, tasks per node of an srun step; and late stop signals after a finished run."""

import os
import signal

import pytest

from hpctrain.reliability import slurm
from hpctrain.reliability.signals import StopSignal
from hpctrain.runtime import launched_ranks_on_node

JOB = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "hpctrain", "SLURM_JOB_NODELIST": "n[1-2]",
       "SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "n2"}


def test_outside_slurm_nothing_changes():
    assert slurm.current({}) is None
    assert slurm.checkpoint_dir("runs/ckpt", "runs/ckpt", env={}) == "runs/ckpt"
    assert slurm.step_tasks_on_node({}) is None


def test_job_fields_and_tag():
    job = slurm.current(JOB)
    assert (job.job_id, job.name, job.node_list, job.n_nodes, job.node_name) == ("1234", "hpctrain", "n[1-2]", 2, "n2")
    assert job.restart_count == 0 and job.end_time is None and job.tag == "1234"
    task = slurm.current({**JOB, "SLURM_JOB_ID": "1236", "SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "2",
                          "SLURM_RESTART_COUNT": "3"})
    assert task.tag == "1234_2" and task.restart_count == 3  # the array's name, stable across requeues


def test_a_step_on_fewer_nodes_names_its_own():
    """A restart on the nodes left after a node loss runs as a step of the same allocation: its
    start-up line names the step's nodes, not the allocation's."""
    step = slurm.current({**JOB, "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_NUM_NODES": "1"})
    assert (step.node_list, step.n_nodes) == ("n1", 1)
    assert "1 node(s) n1" in slurm.describe(step)


def test_checkpoint_dir_is_per_job_only_when_left_at_the_default():
    assert slurm.checkpoint_dir("runs/ckpt", "runs/ckpt", env=JOB) == os.path.join("runs/ckpt", "1234")
    assert slurm.checkpoint_dir("runs/ckpt/", "runs/ckpt", env=JOB) == os.path.join("runs/ckpt/", "1234")
    assert slurm.checkpoint_dir("/scratch/me/ck", "runs/ckpt", env=JOB) == "/scratch/me/ck"


def test_metrics_go_to_a_folder_named_after_the_job():
    assert slurm.metrics_path("runs/mlp/metrics.jsonl", env={}) == "runs/mlp/metrics.jsonl"
    assert slurm.metrics_path("runs/mlp/metrics.jsonl", env=JOB) == os.path.join("runs/mlp", "1234", "metrics.jsonl")
    assert slurm.metrics_path("m.jsonl", env=JOB) == os.path.join("1234", "m.jsonl")
    assert slurm.metrics_path("", env=JOB) == ""                                   # off stays off
    assert slurm.metrics_path("runs/1234/m.jsonl", env=JOB) == "runs/1234/m.jsonl"  # already names the job
    task = {**JOB, "SLURM_JOB_ID": "1236", "SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "2"}
    assert slurm.metrics_path("runs/m.jsonl", env=task) == os.path.join("runs", "1234_2", "m.jsonl")
    assert slurm.metrics_path("/scratch/me/m.jsonl", env=JOB) == "/scratch/me/m.jsonl"  # absolute: as given


def test_describe_names_job_nodes_restarts_and_time_left():
    job = slurm.current({**JOB, "SLURM_RESTART_COUNT": "1", "SLURM_JOB_END_TIME": "10000"})
    assert slurm.describe(job, now=10000 - 3723) == ("slurm: job 1234 (hpctrain), 2 node(s) n[1-2], restart 1, "
                                                     "time left 1:02:03")


@pytest.mark.parametrize("spec, node, want", [("4", "0", 4), ("3,1", "1", 1), ("2(x3)", "2", 2),
                                              ("2(x2),1", "2", 1), ("3,1", "5", None), ("garbage", "0", None)])
def test_step_tasks_on_node(spec, node, want):
    assert slurm.step_tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": spec, "SLURM_NODEID": node}) == want


def test_threads_follow_the_srun_step_not_the_job_request(monkeypatch):
    """`srun -n 2` sets no SLURM_NTASKS_PER_NODE; without the step's count each rank took all
    cores for BLAS/numba and 2 ranks on 2 cores ran ~70x slower."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert launched_ranks_on_node() == 2
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")  # the job asked for 8 per node; this step has 2
    assert launched_ranks_on_node() == 2


def test_stop_signals_after_the_run_are_ignored():
    """SLURM's warning may land after the last step, while Python shuts down and has put back
    the default action: ignore_late() keeps exit code 0 or 75 instead of death by SIGUSR1."""
    saved = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGUSR1", "SIGTERM")}
    try:
        stop = StopSignal().__enter__()
        stop.ignore_late()
        os.kill(os.getpid(), signal.SIGUSR1)  # would end this process with the default action
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN and not stop.pending
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)


def test_ranks_yield_their_core_only_when_the_node_is_oversubscribed(monkeypatch):
    """More launched ranks on the node than cores: Open MPI's waiting ranks yield (set before
    MPI_Init); as many ranks as cores or fewer, or a value the user set: left alone."""
    from hpctrain.runtime import YIELD_VAR, yield_when_oversubscribed

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for ranks, want in (("4", "1"), ("3", "1"), ("2", None), ("1", None)):
        monkeypatch.delenv(YIELD_VAR, raising=False)
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", ranks)
        yield_when_oversubscribed()
        assert os.environ.get(YIELD_VAR) == want, ranks
    monkeypatch.setenv(YIELD_VAR, "0")  # the user's choice wins
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    yield_when_oversubscribed()
    assert os.environ[YIELD_VAR] == "0"

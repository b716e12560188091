"""What SLURM tells a job through its environment: job, array task, nodes, restarts, time limit.

Read-only and MPI-free; used by ``train`` (one log line at start-up, the
default checkpoint directory and the metrics path) and by ``info``. Outside SLURM, :func:`current`
returns None and nothing changes.

The default checkpoint directory inside a job is ``runs/ckpt/<job>`` (see
:func:`checkpoint_dir`): a requeued job keeps its job id, so ``--resume auto``
finds its own checkpoints, and the tasks of a job array, which share one
submit directory, never resume from each other's. A relative metrics path gets
a folder named after the job beside the configured file (:func:`metrics_path`).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class SlurmJob:
    """One SLURM job (or array task) as its environment describes it.

    job_id         SLURM_JOB_ID; an array task has its own, and ``tag`` names it by the array's
    array_job_id   SLURM_ARRAY_JOB_ID ("" outside an array)
    array_task_id  SLURM_ARRAY_TASK_ID ("" outside an array)
    name           SLURM_JOB_NAME
    node_list      the nodes this process's srun step runs on (SLURM_STEP_NODELIST), else the
                   allocation's (SLURM_JOB_NODELIST), compressed (``n[1-2]``): a restart on the
                   nodes left after a node loss names those
    n_nodes        their count (SLURM_STEP_NUM_NODES, else SLURM_JOB_NUM_NODES)
    node_name      SLURMD_NODENAME: the node this process runs on ("" outside a job step)
    restart_count  SLURM_RESTART_COUNT: requeues so far (absent before the first one, so 0)
    end_time       SLURM_JOB_END_TIME (epoch seconds; Slurm >= 23.02 sets it), else None
    """

    job_id: str
    array_job_id: str = ""
    array_task_id: str = ""
    name: str = ""
    node_list: str = ""
    n_nodes: int = 0
    node_name: str = ""
    restart_count: int = 0
    end_time: float | None = None

    @property
    def tag(self) -> str:
        """The job's name in file names: ``<array job>_<task>`` for an array task, else the job id."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


def _int(value: str | None, default: int = 0) -> int:
    try:
        return int(value) if value else default
    except ValueError:
        return default


def current(env=None) -> SlurmJob | None:
    """The job this process belongs to, or None outside SLURM (no SLURM_JOB_ID)."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID", "")
    if not job_id:
        return None
    end = _int(env.get("SLURM_JOB_END_TIME"))
    return SlurmJob(job_id=job_id,
                    array_job_id=env.get("SLURM_ARRAY_JOB_ID", ""),
                    array_task_id=env.get("SLURM_ARRAY_TASK_ID", ""),
                    name=env.get("SLURM_JOB_NAME", ""),
                    node_list=(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                               or env.get("SLURM_NODELIST", "")),
                    n_nodes=_int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES")
                                 or env.get("SLURM_NNODES")),
                    node_name=env.get("SLURMD_NODENAME", ""),
                    restart_count=_int(env.get("SLURM_RESTART_COUNT")),
                    end_time=float(end) if end else None)


def step_tasks_on_node(env=None) -> int | None:
    """Tasks of this srun step on this node (SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID), None outside a step.

    ``srun -n 4 -N 2`` sets the list ``3,1`` or ``2(x2)``; SLURM_NTASKS_PER_NODE
    is only there when the job asked for --ntasks-per-node, and is the job's
    request, not the step's.
    """
    env = os.environ if env is None else env
    spec, node = env.get("SLURM_STEP_TASKS_PER_NODE", ""), _int(env.get("SLURM_NODEID"), -1)
    counts = []
    for item in filter(None, spec.split(",")):
        count, _, times = item.partition("(x")
        if not count.isdigit() or (times and not times.rstrip(")").isdigit()):
            return None
        counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return counts[node] if 0 <= node < len(counts) else None


def checkpoint_dir(configured: str, default: str, env=None) -> str:
    """Where checkpoints go: ``default`` becomes ``default/<job tag>`` inside a SLURM job.

    Called with checkpoint.dir and its built-in default; a directory the user
    chose (anything but the default) is kept as it is, inside SLURM or not.
    """
    job = current(env)
    if job is None or os.path.normpath(configured) != os.path.normpath(default):
        return configured
    return os.path.join(configured, job.tag)


def metrics_path(configured: str, env=None) -> str:
    """Where the metrics go: inside a SLURM job, a relative ``dir/file`` becomes ``dir/<job tag>/file``.

    A relative path is relative to the submit directory, which every job
    submitted from there shares: jobs that share a config (the examples'
    ``runs/mlp/metrics.jsonl``) then keep their own records, and a requeued job
    (same id) finds its file again to append to. An absolute path (yours, or a
    benchmark's), a path that already names the job (a component equal to its
    tag, e.g. ``runs/$SLURM_JOB_ID/m.jsonl``) and "" (off) are kept as they are.
    """
    job = current(env)
    if (job is None or not configured or os.path.isabs(configured)
            or job.tag in os.path.normpath(configured).split(os.sep)):
        return configured
    head, tail = os.path.split(configured)
    return os.path.join(head, job.tag, tail)


def query_end_time(job: SlurmJob, timeout: float = 5.0) -> float | None:
    """The job's end time (epoch seconds): from the environment, else asked of ``squeue``.

    Slurm before 23.02 exports no time limit to the job, so this asks the
    controller once (one RPC; call it on one rank). None if unknown or unlimited.
    """
    if job.end_time is not None:
        return job.end_time
    try:
        out = subprocess.run(["squeue", "-h", "-j", job.job_id, "-o", "%e"], capture_output=True, text=True,
                             timeout=timeout).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except (OSError, subprocess.SubprocessError, ValueError):  # no squeue, no answer, "N/A", "NONE"
        return None


def describe(job: SlurmJob, now: float | None = None) -> str:
    """One log line: ``slurm: job 12_3 (name), 2 node(s) n[1-2], restart 1, time left 0:58:10``."""
    parts = [f"job {job.tag}" + (f" ({job.name})" if job.name else "")]
    if job.node_list:
        parts.append(f"{job.n_nodes or '?'} node(s) {job.node_list}")
    if job.restart_count:
        parts.append(f"restart {job.restart_count}")
    end = query_end_time(job)
    if end is not None:
        left = max(0, int(end - (time.time() if now is None else now)))
        parts.append(f"time left {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}")
    return "slurm: " + ", ".join(parts)

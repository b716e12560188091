"""``launch --srun`` without a cluster: the allocation read from SLURM's variables, the usable-node
choice (SLURM states, then a one-task srun per node, with a time limit) and giving up when no node
is left, against stand-in ``scontrol``, ``sinfo`` and ``srun`` scripts on PATH. The real cluster
runs in tests/test_slurm.py."""

import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO
from hpctrain.reliability.launch import Supervisor, split_args
from hpctrain.reliability.launch_backends import NoNodes, Srun, tasks_per_node

# sinfo's view; srun's probe of n3 fails, of n4 hangs; a training step exits as TRAIN_RC says
SCONTROL = "#!/bin/sh\nfor n in n1 n2 n3 n4; do echo $n; done\n"
SINFO = "#!/bin/sh\nprintf 'n1 alloc\\nn2 down*\\nn3 mix\\nn4 idle\\n'\n"
SRUN = """#!/bin/sh
case " $* " in
  *" true "*)
    [ -n "$ALL_DEAD" ] && { echo "srun: error: Job step aborted" >&2; exit 1; }
    case " $* " in
      *" -w n3 "*) [ -n "$HANG_N3" ] && exec sleep 30; echo "srun: error: Task launch for StepId=7.3 failed on node n3: Communication connection failure" >&2; exit 1 ;;
      *" -w n4 "*) exec sleep 30 ;;
    esac
    exit 0 ;;
esac
echo "srun $*"
exit "${TRAIN_RC:-0}"
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    for name, text in (("scontrol", SCONTROL), ("sinfo", SINFO), ("srun", SRUN)):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_NTASKS": "8",
            "SLURM_JOB_NUM_NODES": "4", "SLURM_TASKS_PER_NODE": "2(x4)"}


@pytest.mark.parametrize("env, want", [({"SLURM_NTASKS_PER_NODE": "4"}, 4), ({"SLURM_TASKS_PER_NODE": "2(x3)"}, 2),
                                       ({"SLURM_TASKS_PER_NODE": "4(x2),3"}, 3),
                                       ({"SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"}, 4), ({}, None)])
def test_tasks_per_node_from_slurms_variables(env, want):
    assert tasks_per_node(env) == want


def test_under_srun_every_option_but_max_failures_is_sruns(monkeypatch):
    monkeypatch.delenv("HPCTRAIN_MAX_FAILURES", raising=False)
    assert split_args(["--srun", "--mpi=pmix", "--", "train", "--config", "x.toml"]) == \
        (None, 3, ["--mpi=pmix"], ["train", "--config", "x.toml"], True)
    assert split_args(["-n", "4", "--max-failures", "2", "--srun", "-N", "2", "--", "train"]) == \
        (None, 2, ["-n", "4", "-N", "2"], ["train"], True)


def test_a_restart_runs_on_the_nodes_that_pass_both_checks(fake_slurm):
    said = []
    backend = Srun(["--mpi=pmix", "-n", "8"], env=fake_slurm, probe_s=1.0)
    assert backend.problem() is None
    argv, where = backend.start(0, ["train", "--config", "x.toml"], said.append)
    assert argv[:5] == ["srun", "--kill-on-bad-exit=1", "--mpi=pmix", "-n", "8"], argv
    assert where.startswith("8 rank(s) on 4 node(s)")
    argv, where = backend.start(1, ["train", "--config", "x.toml", "--resume", "auto"], said.append)
    # the restart's geometry after the user's options: srun takes the last -n
    assert argv[:12] == ["srun", "--kill-on-bad-exit=1", "--mpi=pmix", "-n", "8", "--overlap", "-N", "1", "-n", "2",
                         "-w", "n1"], argv
    assert argv[12:] == [sys.executable, "-m", "hpctrain", "train", "--config", "x.toml", "--resume", "auto"]
    assert where == "2 rank(s) on 1 node(s) n1 (3 of 4 lost)"
    assert said == ["node n2 is not usable: SLURM state 'down*'",
                    "node n3 is not usable: a one-task srun failed (srun: error: Task launch for StepId=7.3 failed on "
                    "node n3: Communication connection failure)",
                    "node n4 is not usable: a one-task srun did not finish in 1 s"]


def test_no_usable_node_left_is_no_nodes(fake_slurm, monkeypatch):
    monkeypatch.setenv("ALL_DEAD", "1")
    backend = Srun([], env=fake_slurm, probe_s=0.5)
    assert backend.problem() is None
    with pytest.raises(NoNodes, match=r"none of the allocation's nodes \(n1,n2,n3,n4\)"):
        backend.start(1, ["train"], lambda line: None)


def test_outside_an_allocation_is_one_clear_error(fake_slurm):
    assert "inside a SLURM allocation (SLURM_JOB_ID is not set)" in Srun([], env={}).problem()


def test_the_launcher_gives_up_when_a_failed_job_has_no_node_left(fake_slurm):
    env = dict(os.environ, **fake_slurm, TRAIN_RC="137", ALL_DEAD="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "launch", "--srun", "--", "train", "--config", "x.toml"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 6, (proc.stdout, proc.stderr)
    assert "failure 1: exit code 137 (a rank killed by signal 9, SIGKILL) before its first step" in proc.stdout
    assert proc.stderr.count("hpctrain launch: error:") == 1
    assert "giving up: none of the allocation's nodes (n1,n2,n3,n4) can run a task any more" in proc.stderr


def test_progress_marks_go_only_where_the_launcher_asks(tmp_path, monkeypatch):
    """The launcher's marks use their own variable: HPCTRAIN_PROGRESS picks the progress display
    (tty | lines), and a run with HPCTRAIN_PROGRESS=lines once wrote its marks to a file named lines."""
    from hpctrain.reliability import progress

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HPCTRAIN_PROGRESS", "lines")
    monkeypatch.delenv(progress.ENV, raising=False)
    marks = progress.Progress(is_root=True)
    marks.mark("start", 0)
    marks.close()
    assert os.listdir(tmp_path) == []
    monkeypatch.setenv(progress.ENV, str(tmp_path / "marks"))
    marks = progress.Progress(is_root=True)
    marks.mark("ready", 7)
    marks.close()
    assert progress.read(str(tmp_path / "marks"))["ready"].step == 7


def test_probes_that_hang_share_one_time_limit(fake_slurm, monkeypatch):
    """n3 and n4 both hang: they run at once, so the restart waits one probe limit, not two."""
    monkeypatch.setenv("HANG_N3", "1")
    said = []
    backend = Srun([], env=fake_slurm, probe_s=2.0)
    assert backend.problem() is None
    t0 = time.monotonic()
    argv, where = backend.start(1, ["train"], said.append)
    took = time.monotonic() - t0
    assert where == "2 rank(s) on 1 node(s) n1 (3 of 4 lost)", (where, said)
    assert sum("did not finish in 2 s" in line for line in said) == 2, said
    assert took < 3.8, f"{took:.1f} s: the probes' limits added up (two of 2 s each)"


class _Backend:
    """One failing start, then a restart during which the stop signal arrives (as during the probes)."""

    def __init__(self, marker):
        self.marker, self.supervisor = marker, None

    def problem(self):
        return None

    def progress_dir(self):
        return None

    def start(self, restart, command, say, lost_nodes=()):
        if restart:
            self.supervisor._forward(signal.SIGTERM, None)
            return [sys.executable, "-c", f"open({str(self.marker)!r}, 'w')"], "here"
        return [sys.executable, "-c", "raise SystemExit(1)"], "here"


def test_a_stop_signal_between_a_failure_and_its_restart_starts_nothing(tmp_path, capsys):
    backend = _Backend(tmp_path / "restarted")
    sup = backend.supervisor = Supervisor(backend, 3, ["train"])
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        assert sup.run() == 75
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    out = capsys.readouterr().out
    assert not (tmp_path / "restarted").exists(), out
    assert "failure 1: exit code 1" in out and "SIGTERM arrived between a failure and its restart" in out, out


class _StartingJob(_Backend):
    """The stop signal reaches a job whose Python has not yet set hpctrain's handler: SIGUSR1 kills it."""

    def start(self, restart, command, say, lost_nodes=()):
        # _forward's record of the signal, once the job runs (before its Python could set a handler)
        threading.Timer(0.1, lambda: setattr(self.supervisor, "stop", "SIGUSR1")).start()
        return [sys.executable, "-c", "import os, signal, time; time.sleep(1); os.kill(os.getpid(), signal.SIGUSR1)"], \
            "here"


def test_a_job_stopped_before_it_could_save_counts_as_saved(tmp_path, capsys):
    backend = _StartingJob(tmp_path / "unused")
    sup = backend.supervisor = Supervisor(backend, 3, ["train"])
    assert sup.run() == 75  # 138 before: requeue.sbatch then took it for a failure and did not requeue
    assert "reached the job before it could save (still starting): nothing lost" in capsys.readouterr().out


def test_a_restart_leaves_the_nodes_the_heartbeats_lost_out_without_probing_them(fake_slurm):
    """n4's ranks stopped answering: it is left out at once (its probe would only have waited out the
    limit); n2 is down by sinfo, n3's probe fails; n1 is what is left."""
    backend = Srun(["--mpi=pmix"], env=fake_slurm, probe_s=20)
    assert backend.problem() is None
    said = []
    t0 = time.monotonic()
    argv, where = backend.start(1, ["train"], said.append, lost_nodes=("n4",))
    assert time.monotonic() - t0 < 5.0, said  # no 20 s wait on n4
    assert where == "2 rank(s) on 1 node(s) n1 (3 of 4 lost)", (where, said)
    assert "node n4 is not usable: its ranks stopped answering (no heartbeat)" in said, said
    assert backend.probed


def test_tearing_down_under_srun_cancels_the_running_steps_and_kills_srun(fake_slurm, tmp_path):
    """squeue lists the job's steps (the batch and extern steps among them): the numbered ones get
    scancel --signal=KILL, not waited for; srun itself gets SIGKILL."""
    log = tmp_path / "scancel.log"
    for name, text in (("squeue", "#!/bin/sh\nprintf '7.batch\\n7.extern\\n7.3\\n'\n"),
                       ("scancel", f"#!/bin/sh\necho \"$*\" >> {log}\nsleep 30\n")):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    backend = Srun([], env=fake_slurm)
    srun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.monotonic()
    backend.tear_down(srun, print)
    assert srun.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - t0 < 5.0  # scancel's sleep not waited
    for _ in range(50):
        if log.exists():
            break
        time.sleep(0.05)
    assert log.read_text().split() == ["--signal=KILL", "7.3"]
    for proc in backend.cancelling:
        proc.kill()


def test_tearing_down_under_mpirun_kills_every_process_under_it_a_stopped_one_too():
    from hpctrain.reliability.launch_backends import Mpirun

    root = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"])
    time.sleep(0.3)
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(root.pid)], capture_output=True,
                                               text=True).stdout.split()]
    assert len(children) == 2
    os.kill(children[0], signal.SIGSTOP)
    Mpirun(2, []).tear_down(root, print)
    assert root.wait(timeout=5) == -signal.SIGKILL
    time.sleep(0.2)
    for pid in children:
        state = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}") else "gone"
        assert state in ("gone", "Z"), (pid, state)

"""scripts/test_summary.py, the suite's closing line: a test run on N ranks counts once, a
failure on any rank fails it, and a run's missing report (a killed rank) is a failure; the
real-GPU pass's 2-rank run (mpi-ngpu-rankR.xml) is one run like the others."""

import os
import subprocess
import sys

from conftest import REPO


def junit(path, cases):
    """A JUnit file of (name, outcome) cases, outcome one of passed, failed, skipped."""
    body = "".join(f'<testcase classname="t" name="{n}">' + {"passed": "", "failed": "<failure/>",
                                                             "skipped": "<skipped/>"}[o] + "</testcase>"
                   for n, o in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>')


def summary(folder):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "test_summary.py"), str(folder)],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout


def base(folder):
    junit(folder / "serial.xml", [("a", "passed"), ("b", "skipped")])
    junit(folder / "exclusive.xml", [("c", "passed")])
    for n in (1, 2, 3, 4):
        for r in range(n):
            junit(folder / f"mpi-n{n}-rank{r}.xml", [("m", "passed")])


def test_each_run_counts_once_across_its_ranks(tmp_path):
    base(tmp_path)
    assert summary(tmp_path) == (0, "suite: 6 passed, 0 failed, 1 skipped\n")   # a, c, m x 4 runs
    junit(tmp_path / "gpu.xml", [("g", "passed")])
    for r in (0, 1):
        junit(tmp_path / f"mpi-ngpu-rank{r}.xml", [("m", "passed"), ("s", "skipped")])
    assert summary(tmp_path) == (0, "suite: 8 passed, 0 failed, 2 skipped\n")


def test_a_failure_on_one_rank_or_a_missing_rank_fails_the_run(tmp_path):
    base(tmp_path)
    junit(tmp_path / "gpu.xml", [("g", "passed")])
    junit(tmp_path / "mpi-ngpu-rank0.xml", [("m", "passed")])
    rc, out = summary(tmp_path)   # rank 1's report of the GPU pass is missing
    assert rc == 1 and "FAILED mpi-ngpu-rank1: no report" in out
    junit(tmp_path / "mpi-ngpu-rank1.xml", [("m", "failed")])
    rc, out = summary(tmp_path)
    assert rc == 1 and "FAILED mpi-ngpu rank 1: t::m" in out and "1 failed" in out

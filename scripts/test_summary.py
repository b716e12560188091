"""Add up the JUnit XML files of a suite run into one closing line.

A test run under mpirun -n N (mpi-nN-rankR.xml; mpi-ngpu-rankR.xml: the real-GPU pass's 2
ranks) counts once per run; it failed if it failed on any
rank. A missing report (a rank killed by a timeout or abort) counts as a failure. Prints every failure with its rank, then 'suite: P passed, F failed, S skipped'.
Exit status 1 if anything failed or no test ran.
"""

import glob
import os
import re
import sys
import xml.etree.ElementTree as ET


def main(folder: str, sizes=(1, 2, 3, 4)) -> int:
    outcomes = {}  # (run, test id) -> "passed" | "failed" | "skipped"
    failures = []
    # a rank killed by a timeout or an abort writes no XML: that is a failure
    expected = ["serial.xml", "exclusive.xml"] + [f"mpi-n{n}-rank{r}.xml" for n in sizes for r in range(n)]
    if os.path.exists(os.path.join(folder, "gpu.xml")):  # the real-GPU pass ran: its 2-rank run too
        expected += ["mpi-ngpu-rank0.xml", "mpi-ngpu-rank1.xml"]
    for name in expected:
        if not os.path.exists(os.path.join(folder, name)):
            failures.append(f"{name[:-4]}: no report (killed, timed out or never started)")
            outcomes[(name, "<run>")] = "failed"
    for path in sorted(glob.glob(os.path.join(folder, "*.xml"))):
        name = os.path.basename(path)[:-4]
        m = re.match(r"(mpi-n(?:\d+|gpu))-rank(\d+)$", name)   # mpi-ngpu: the real-GPU pass's 2 ranks
        run, rank = (m.group(1), int(m.group(2))) if m else (name, 0)
        for case in ET.parse(path).getroot().iter("testcase"):
            test = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                state = "failed"
                failures.append(f"{run} rank {rank}: {test}")
            elif case.find("skipped") is not None:
                state = "skipped"
            else:
                state = "passed"
            key = (run, test)
            if outcomes.get(key) != "failed":
                outcomes[key] = state if rank == 0 or state == "failed" else outcomes.get(key, state)
    for line in failures:
        print(f"FAILED {line}")
    counts = {s: sum(1 for v in outcomes.values() if v == s) for s in ("passed", "failed", "skipped")}
    print(f"suite: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] or not counts["passed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".test-logs"))

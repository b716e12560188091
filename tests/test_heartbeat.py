"""Heartbeats outside MPI (hpctrain/reliability/heartbeat.py): ranks beat over UDP once a second,
the launcher's listener names the ranks that fell silent, and a node is lost when all of its ranks
are. The launcher acting on it (tearing a job down, restarting) is tests/test_launch.py's."""

import os
import socket
import time

import pytest

from hpctrain.errors import ConfigError
from hpctrain.reliability import heartbeat
from hpctrain.reliability.launch import Lost


def _wait_heard(listener, ranks, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        listener.poll()
        if set(listener.heard) >= set(ranks):
            return
        time.sleep(0.01)
    raise AssertionError(f"heard {sorted(listener.heard)}, expected {sorted(ranks)}")


def test_beats_arrive_and_silence_is_named_after_the_limit():
    listener = heartbeat.Listener(host="127.0.0.1")
    env = {heartbeat.ENV: listener.env_value(0)}
    beacons = [heartbeat.Beacon(rank, env=env, period_s=0.05) for rank in (0, 1, 2)]
    try:
        for b in beacons:
            b.start()
        _wait_heard(listener, [0, 1, 2])
        assert listener.silent(0.5) == []
        beacons[1].stop(bye=False)  # rank 1 falls silent, as a dead one does
        time.sleep(0.6)
        listener.poll()
        silent = listener.silent(0.5)
        assert [r for r, _, _ in silent] == [1] and silent[0][2] > 0.5
    finally:
        for b in beacons:
            b.stop()
        listener.close()


def test_beats_of_an_earlier_start_are_ignored():
    listener = heartbeat.Listener(host="127.0.0.1")
    old = heartbeat.Beacon(0, env={heartbeat.ENV: listener.env_value(0)}, period_s=0.05)
    listener.env_value(1)  # the launcher restarted the job: start 1
    new = heartbeat.Beacon(1, env={heartbeat.ENV: listener.env_value(1)}, period_s=0.05)
    try:
        old.start(), new.start()
        _wait_heard(listener, [1])
        time.sleep(0.2)
        listener.poll()
        assert set(listener.heard) == {1}
    finally:
        old.stop(), new.stop()
        listener.close()


def test_no_launcher_no_beacon():
    beacon = heartbeat.Beacon(0, env={})
    beacon.start()
    assert not beacon.enabled and beacon._proc is None
    assert heartbeat._parse("host:12:3") == ("host", 12, 3) and heartbeat._parse("nonsense") is None


def test_the_detect_limit_comes_from_the_environment():
    assert heartbeat.detect_s({}) == heartbeat.DETECT_S
    assert heartbeat.detect_s({"HPCTRAIN_DETECT_S": "2.5"}) == 2.5
    assert heartbeat.detect_s({"HPCTRAIN_DETECT_S": "0"}) == 0.0
    with pytest.raises(ConfigError, match="HPCTRAIN_DETECT_S='soon'"):
        heartbeat.detect_s({"HPCTRAIN_DETECT_S": "soon"})


def test_a_node_is_lost_when_every_rank_heard_from_it_is_silent():
    heard = {"n1": [0, 1], "n2": [2, 3]}
    node = Lost([(2, "n2", 10.5), (3, "n2", 10.2)], heard)
    assert node.nodes == ["n2"] and node.ranks == [2, 3]
    assert node.describe().startswith("node(s) n2 stopped answering (rank(s) 2, 3 silent for 10.2 s")
    rank = Lost([(1, "n1", 11.0)], heard)
    assert rank.nodes == [] and rank.ranks == [1]
    assert "their nodes' other ranks still beat" in rank.describe()


def test_a_rank_that_says_bye_is_no_longer_judged():
    """A rank done with its run stops its beacon (Trainer.close): the last datagram says so, and its
    process may take as long as it likes to end."""
    listener = heartbeat.Listener(host="127.0.0.1")
    env = {heartbeat.ENV: listener.env_value(0)}
    beacon = heartbeat.Beacon(0, env=env, period_s=0.05)
    try:
        beacon.start()
        _wait_heard(listener, [0])
        beacon.stop()
        time.sleep(0.3)
        listener.poll()
        assert listener.silent(0.1) == [] and listener.done == {0}
    finally:
        beacon.stop()
        listener.close()


def test_a_bye_carries_the_runs_exit_code_and_all_done_waits_for_the_grace():
    """Ranks end their runs (exit 3, a target missed): each bye carries the code. The start is all
    done only when the latest bye is older than the grace and no rank has beaten for as long: a
    rank still beating keeps it running; a rank silent without a bye (its bye dropped, or dead in
    its exit) counts as done once silent for the grace. A bye without a code is kept as unknown."""
    listener = heartbeat.Listener(host="127.0.0.1")
    env = {heartbeat.ENV: listener.env_value(0)}
    beacons = [heartbeat.Beacon(rank, env=env, period_s=0.05) for rank in (0, 1, 2, 3)]
    try:
        for b in beacons:
            b.start()
        _wait_heard(listener, [0, 1, 2, 3])
        beacons[0].stop(code=3)
        beacons[1].stop(code=3)
        time.sleep(0.3)
        listener.poll()
        assert listener.done == {0, 1} and listener.codes == {0: 3, 1: 3}
        assert not listener.all_done(0.2)           # the byes are 0.3 s old, but ranks 2 and 3 still beat
        beacons[2].stop(bye=False)                  # rank 2's bye lost: it falls silent
        beacons[3].stop()                           # rank 3 raised: a bye without a code
        time.sleep(0.2)
        listener.poll()
        assert listener.codes == {0: 3, 1: 3, 3: None} and set(listener.heard) == {2}
        last_beat = listener.heard[2][0]
        assert not listener.all_done(1.0, now=max(listener.last_bye, last_beat) + 0.5)
        assert listener.all_done(1.0, now=max(listener.last_bye, last_beat) + 1.5)
    finally:
        for b in beacons:
            b.stop()
        listener.close()


def test_the_exit_grace_comes_from_the_environment():
    assert heartbeat.exit_grace_s({}) == heartbeat.EXIT_GRACE_S
    assert heartbeat.exit_grace_s({"HPCTRAIN_EXIT_GRACE_S": "2"}) == 2.0
    assert heartbeat.exit_grace_s({"HPCTRAIN_EXIT_GRACE_S": "0"}) == 0.0   # never
    for bad in ("later", "-1", "nan"):
        with pytest.raises(ConfigError, match="HPCTRAIN_EXIT_GRACE_S"):
            heartbeat.exit_grace_s({"HPCTRAIN_EXIT_GRACE_S": bad})


def test_the_listener_keeps_the_largest_gap():
    listener = heartbeat.Listener(host="127.0.0.1")
    listener.env_value(0)
    try:
        send = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        port = listener.sock.getsockname()[1]
        for t in (0.0, 1.0, 3.5, 4.0):
            send.sendto(b"0 n1 0", ("127.0.0.1", port))
            time.sleep(0.05)
            listener.poll(now=t)
        send.close()
        assert listener.largest_gap == 2.5
    finally:
        listener.close()


def test_the_beacon_falls_silent_while_its_rank_is_stopped_and_ends_with_it():
    """The beacon beats for its rank's process (here a child standing in for a rank): silent while
    that process is stopped (SIGSTOP), beating again when it continues; when it dies the beacon
    says so (its node lives: not a silence to judge) and ends."""
    import signal
    import subprocess
    import sys

    listener = heartbeat.Listener(host="127.0.0.1")
    env_value = listener.env_value(0)
    rank = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                             "from hpctrain.reliability import heartbeat\n"
                             f"b = heartbeat.Beacon(7, env={{'{heartbeat.ENV}': '{env_value}'}}, period_s=0.05)\n"
                             "b.start(); print(b._proc.pid, flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        beacon_pid = int(rank.stdout.readline())
        _wait_heard(listener, [7])
        rank.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        listener.poll()
        assert [r for r, _, _ in listener.silent(0.3)] == [7]
        rank.send_signal(signal.SIGCONT)
        time.sleep(0.3)
        listener.poll()
        assert listener.silent(0.2) == []
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.path.exists(f"/proc/{beacon_pid}"):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{beacon_pid}") or open(f"/proc/{beacon_pid}/stat").read().split()[2] == "Z"
        time.sleep(0.1)
        listener.poll()
        assert listener.gone == {7: socket.gethostname()} and 7 not in listener.heard and listener.silent(0.0) == []
    finally:
        rank.kill()
        listener.close()


def test_the_ranks_of_a_crashed_node_are_lost_together_though_they_beat_out_of_phase():
    """n2's two ranks last beat 0.8 s apart (their beacons started at different moments): when the
    first passes the limit, the other has missed beats too, so the node is lost, not one rank of
    a node that still beats (which would be probed: 10 s or more on a dead node). n1's ranks,
    heard a moment ago, are not."""
    from hpctrain.reliability.launch import Supervisor

    class Backend:
        torn = 0

        def tear_down(self, proc, say):
            Backend.torn += 1

    said = []
    sup = Supervisor(Backend(), 3, ["train"], say=said.append, detect_s=5.0)
    sup.listener = heartbeat.Listener(host="127.0.0.1")
    try:
        now = time.monotonic()
        sup.listener.heard = {0: (now - 0.3, "n1"), 1: (now - 0.9, "n1"), 2: (now - 5.2, "n2"), 3: (now - 4.4, "n2")}
        lost = sup._heard_lost()
        assert lost is not None and lost.nodes == ["n2"] and lost.ranks == [2, 3], said
        assert Backend.torn == 1 and said[0].startswith("node(s) n2 stopped answering (rank(s) 2, 3 silent for 4.4")
        sup.listener.heard = {0: (now - 0.3, "n1"), 1: (now - 0.9, "n1"), 2: (now - 4.0, "n2")}
        assert sup._heard_lost() is None and Backend.torn == 1   # nobody over the limit yet
        # rank 3's process died and its beacon said so: the job's end is mpirun's or srun's to report,
        # and the silence of the others (torn down with it) is no verdict
        sup.listener.heard, sup.listener.gone = {0: (now - 5.3, "n1"), 2: (now - 5.2, "n2")}, {3: "n2"}
        assert sup._heard_lost() is None and Backend.torn == 1
    finally:
        sup.listener.close()

"""The metrics file (hpctrain/observe/log.py Metrics): a fresh start empties it, a resumed run keeps
the records of the steps its checkpoint holds and drops later ones (a failed attempt wrote them), so
the file holds every step once; sync() puts what was written on disk. The whole path, a rank killed
after a checkpoint and the job restarted, is tests/test_launch.py's kill -9 test."""

import json

from hpctrain.observe.log import Metrics


def _steps(path):
    return [json.loads(line)["step"] for line in open(path)]


def test_a_fresh_start_empties_an_older_runs_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    m = Metrics(str(path), True)
    m.begin(None)
    m.write(step=1, loss=0.5)
    m.close()
    assert _steps(path) == [1]


def test_a_resume_keeps_the_steps_of_its_checkpoint_and_drops_later_ones(tmp_path):
    """Resumed at step 3 after an attempt that wrote steps 1..5 and half a line of step 6: the
    records of steps 4 and 5 and the cut line go, and the resumed run's 4.. follow 1..3."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    m = Metrics(str(path), True)
    m.begin(3)
    for s in (4, 5, 6):
        m.write(step=s, loss=-s)
    m.close()
    records = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [0.1, 0.2, 0.3, -4, -5, -6]


def test_a_resume_at_a_step_the_file_never_reached_keeps_it_whole(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    m = Metrics(str(path), True)
    m.begin(10)
    m.write(step=11)
    m.close()
    assert _steps(path) == [1, 2, 11]


def test_sync_puts_the_records_on_disk_before_close(tmp_path):
    path = tmp_path / "m.jsonl"
    m = Metrics(str(path), True)
    m.begin(None)
    m.write(step=1, loss=0.25)
    assert path.read_text() == ""  # buffered
    m.sync()
    assert _steps(path) == [1]
    m.close()


def test_other_ranks_write_nothing(tmp_path):
    path = tmp_path / "m.jsonl"
    m = Metrics(str(path), False)
    m.begin(3), m.write(step=1), m.sync(), m.close()
    assert not path.exists()

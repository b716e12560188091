"""Pipeline schedules (hpctrain/training/schedules.py): the instruction lists against hand-checked
ones, and, for every p <= 4 and m <= 8, simulated: messages pair up in order, no stage waits
forever, each stage's peak of micro-batches in flight is the schedule's (GPipe m, 1F1B
min(p - s, m)), and a step takes (m + p - 1)(f + b), the bubble (p - 1) / (m + p - 1)."""

import pytest

from hpctrain.errors import ConfigError
from hpctrain.training.schedules import (SCHEDULES, Instr, ScheduleError, bubble_fraction, describe, schedule,
                                         simulate, stage_schedule)


def text(instrs):
    return " ".join(map(str, instrs))


def test_1f1b_for_2_stages_and_4_micro_batches_is_the_hand_checked_one():
    """Stage 0 runs one forward ahead, then alternates; stage 1 (the last) alternates from the start."""
    s0, s1 = schedule("1f1b", 2, 4)
    assert text(s0) == "F0 sF0 F1 sF1 rB0 B0 F2 sF2 rB1 B1 F3 sF3 rB2 B2 rB3 B3"
    assert text(s1) == "rF0 F0 B0 sB0 rF1 F1 B1 sB1 rF2 F2 B2 sB2 rF3 F3 B3 sB3"
    assert describe("1f1b", 2, 4).splitlines()[1:] == [f"  stage 0: {text(s0)}", f"  stage 1: {text(s1)}"]


def test_gpipe_for_2_stages_and_4_micro_batches_is_the_hand_checked_one():
    s0, s1 = schedule("gpipe", 2, 4)
    assert text(s0) == "F0 sF0 F1 sF1 F2 sF2 F3 sF3 rB0 B0 rB1 B1 rB2 B2 rB3 B3"
    assert text(s1) == "rF0 F0 rF1 F1 rF2 F2 rF3 F3 B0 sB0 B1 sB1 B2 sB2 B3 sB3"
    assert describe("gpipe", 2, 4, compute_only=True).splitlines()[1] == "  stage 0: F0 F1 F2 F3 B0 B1 B2 B3"


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_every_schedule_pairs_its_messages_and_idles_as_the_formula_says(name, p, m):
    stages = schedule(name, p, m)
    for s, instrs in enumerate(stages):   # every micro-batch once forward and once backward, and its messages
        assert [x.micro for x in instrs if x.kind == "forward"] == list(range(m))
        assert sorted(x.micro for x in instrs if x.kind == "backward") == list(range(m))
        # nothing but what the stage runs: per micro-batch its forward and backward, a receive and a
        # send from each neighbour it has; the list ends with the last backward (and its send back)
        assert len(instrs) == m * (2 + 2 * (s > 0) + 2 * (s < p - 1))
        assert instrs[-1].kind == ("send_bwd" if s > 0 else "backward")
    for f, b in ((1.0, 1.0), (1.0, 2.0), (1.0, 3.0)):
        run = simulate(stages, f, b)
        assert run.time == pytest.approx((m + p - 1) * (f + b))
        assert run.idle_fraction == pytest.approx([bubble_fraction(p, m)] * p)
    want = [m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)]
    assert run.peak_in_flight == want


def test_a_schedule_whose_messages_cross_or_wait_on_each_other_is_caught():
    s0, s1 = schedule("gpipe", 2, 2)
    assert text(s1[:4]) == "rF0 F0 rF1 F1"
    swapped = [Instr("recv_fwd", 1), s1[1], Instr("recv_fwd", 0), *s1[3:]]   # receives in the wrong order
    with pytest.raises(ScheduleError, match="would receive micro-batch 0"):
        simulate([s0, swapped])
    # stage 0 waits for a gradient before sending the activation stage 1 waits for
    waits = [Instr("recv_bwd", 0), *[x for x in s0 if x.kind != "recv_bwd" or x.micro != 0]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([waits, s1])


def test_bad_names_and_sizes_are_refused():
    with pytest.raises(ConfigError, match="dist.pipeline_schedule='zb'"):
        stage_schedule("zb", 0, 2, 4)
    with pytest.raises(ValueError):
        stage_schedule("1f1b", 2, 2, 4)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8)])
def test_a_receive_is_posted_only_once_the_micro_batch_before_it_on_its_lane_is_done_with_the_buffer(name, p, m):
    """A receive posted ahead (pipeline.receive_posts) fills a lane's buffer: the micro-batch that
    last held that buffer must be through with it. A received residual stream is read by the
    micro-batch's forward and its backward (the first block's cached input); a received gradient is
    written by the backward in place and sent on from there (or last read by the backward on stage 0)."""
    from hpctrain.training.pipeline import in_flight, receive_posts

    for stage, instrs in enumerate(schedule(name, p, m)):
        lanes = in_flight(instrs)
        posts = receive_posts(instrs, lanes)
        at = {(x.kind, x.micro): q for q, x in enumerate(instrs)}
        receives = [q for q, x in enumerate(instrs) if x.kind in ("recv_fwd", "recv_bwd")]
        assert sorted(posts) == receives
        for q in receives:
            x = instrs[q]
            assert posts[q] < q
            before = x.micro - lanes   # the micro-batch that used this lane last
            if before < 0:
                assert posts[q] == -1   # a lane's first receive: posted as the step starts
                continue
            if x.kind == "recv_fwd":
                done = at["backward", before]
            else:
                done = at.get(("send_bwd", before), at["backward", before])
            assert posts[q] >= done, (stage, str(x), posts[q], done)
        if name == "gpipe" and stage == p - 1 and p > 1:   # every lane its own: all posted at the start
            assert all(posts[q] == -1 for q in receives)

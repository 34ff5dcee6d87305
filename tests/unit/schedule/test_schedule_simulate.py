"""Simulation (times, bubbles, p2p, uneven stages), validation (missing, duplicate, deadlock), grid."""

from fractions import Fraction

import pytest

from megatron_het.schedule import (
    Action,
    Schedule,
    ScheduleError,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    render_grid,
    simulate,
    validate_schedule,
    zero_bubble_h1,
)


def unit(stage, action):
    return 1.0


def f1_b2(stage, action):
    return 1.0 if action.kind == "F" else 2.0


@pytest.mark.parametrize("build", [one_f_one_b, gpipe])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 5), (4, 8), (4, 16)])
def test_bubble_fraction_equal_f_and_b(build, p, m):
    sim = simulate(build(p, m), unit)
    assert sim.iteration_time == 2 * (m + p - 1)
    expected = Fraction(p - 1, m + p - 1)
    assert sim.bubble_fraction == pytest.approx(float(expected))
    assert sim.busy == (2.0 * m,) * p
    assert sim.idle == (2.0 * (p - 1),) * p


def test_hand_computed_p2_m2_f1_b2():
    # stage 0: F0[0,1] F1[1,2] .......... B0[4,6] . B1[7,9]
    # stage 1:   .    F0[1,2] B0[2,4] F1[4,5] B1[5,7]
    sim = simulate(one_f_one_b(2, 2), f1_b2)
    assert sim.iteration_time == 9.0
    s0 = [(str(t.action), t.start, t.end) for t in sim.timings[0]]
    s1 = [(str(t.action), t.start, t.end) for t in sim.timings[1]]
    assert s0 == [("F0", 0, 1), ("F1", 1, 2), ("B0", 4, 6), ("B1", 7, 9)]
    assert s1 == [("F0", 1, 2), ("B0", 2, 4), ("F1", 4, 5), ("B1", 5, 7)]
    assert sim.busy == (6.0, 6.0) and sim.idle == (3.0, 3.0)
    assert sim.stage_bubble_fraction(0) == pytest.approx(1 / 3)
    assert simulate(gpipe(2, 2), f1_b2).iteration_time == 9.0


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8)])
def test_1f1b_formula_f1_b2(p, m):
    assert simulate(one_f_one_b(p, m), f1_b2).iteration_time == (m + p - 1) * 3


def test_uneven_stage_durations_and_p2p():
    # stage 1 is twice as slow: F=2, B=4.
    def dur(stage, a):
        return (1.0 if a.kind == "F" else 2.0) * (2 if stage == 1 else 1)

    # stage 0: F0[0,1] F1[1,2] B0[7,9] B1[13,15]; stage 1: F0[1,3] B0[3,7] F1[7,9] B1[9,13]
    sim = simulate(one_f_one_b(2, 2), dur)
    assert sim.iteration_time == 15.0
    assert sim.busy == (6.0, 12.0) and sim.idle == (9.0, 3.0)

    calls = []

    def p2p(src, dst, action):
        calls.append((src, dst, str(action)))
        return 0.5

    # Every cross-stage dependency waits 0.5 more:
    # stage 1: F0[1.5,3.5] B0[3.5,7.5] F1[7.5,9.5] B1[9.5,13.5]; stage 0: B0[8,10] B1[14,16]
    sim = simulate(one_f_one_b(2, 2), dur, p2p)
    assert sim.iteration_time == 16.0
    assert [(t.start, t.end) for t in sim.timings[0]] == [(0, 1), (1, 2), (8, 10), (14, 16)]
    assert sorted(calls) == [(0, 1, "F0"), (0, 1, "F1"), (1, 0, "B0"), (1, 0, "B1")]


def test_zb_h1_beats_1f1b_when_w_is_a_third_of_backward():
    p, m = 4, 8
    fused = simulate(one_f_one_b(p, m), lambda s, a: 1.0 if a.kind == "F" else 3.0)
    split = simulate(zero_bubble_h1(p, m), lambda s, a: {"F": 1.0, "B": 2.0, "W": 1.0}[a.kind])
    # 1F1B: (m+p-1)(F+B+W) = 11*4; ZB-H1 (paper): m(F+B+W) + (p-1)(F+B-W) = 32 + 3*2
    assert fused.iteration_time == 44.0
    assert split.iteration_time == 38.0
    assert zero_bubble_h1(p, m).peak_in_flight() <= one_f_one_b(p, m).peak_in_flight()
    assert max(zero_bubble_h1(p, m).peak_in_flight()) == max(one_f_one_b(p, m).peak_in_flight()) == p


def test_interleaved_has_smaller_bubble_than_1f1b():
    # Same model: each of the 2 chunks is half a stage, so its F and B take half as long.
    p, m = 4, 8
    plain = simulate(one_f_one_b(p, m), unit)
    inter = simulate(interleaved_1f1b(p, m, 2), lambda s, a: 0.5)
    assert inter.busy == plain.busy
    assert inter.iteration_time < plain.iteration_time
    assert inter.bubble_fraction < plain.bubble_fraction


def _deadlocked() -> Schedule:
    # 1F1B p=2 m=4 with stage 1's B1 and F3 swapped: stage 1 wants F3 before B1, while stage 0
    # only runs F3 after B1, which needs B1 from stage 1.
    good = one_f_one_b(2, 4)
    s1 = list(good.actions[1])
    assert [str(a) for a in s1] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    s1[3], s1[6] = s1[6], s1[3]
    return Schedule(name="broken", num_stages=2, num_micro_batches=4, actions=(good.actions[0], tuple(s1)))


def test_deadlock_is_reported_with_grid_and_stuck_action():
    with pytest.raises(ScheduleError) as e:
        validate_schedule(_deadlocked())
    msg = str(e.value)
    assert "schedule 'broken' deadlocks" in msg
    assert "stage 1 waits for F3 (needs F3 on stage 0)" in msg
    assert "stage 0 waits for B1 (needs B1 on stage 1)" in msg
    assert "stage 0 | F0 F1    B0 F2" in msg  # the grid of what ran
    assert "stage 1 |    F0 B0 F1\nstuck:" in msg
    assert e.value.grid is not None and e.value.grid in msg
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(_deadlocked(), unit)


def test_b_before_own_f_deadlocks_on_one_stage():
    s = Schedule(name="x", num_stages=1, num_micro_batches=1,
                 actions=((Action.parse("B0"), Action.parse("F0")),))
    with pytest.raises(ScheduleError, match="stage 0 waits for B0 \\(needs F0 on stage 0\\)"):
        validate_schedule(s)


def test_missing_and_duplicate_actions():
    good = one_f_one_b(2, 2)
    missing = Schedule(name="x", num_stages=2, num_micro_batches=2,
                       actions=(good.actions[0][:-1], good.actions[1]))
    with pytest.raises(ScheduleError) as e:
        validate_schedule(missing)
    assert str(e.value).startswith("actions[0]: stage 0 is missing 1 of 4 actions (got ['B1'])")
    dup = Schedule(name="x", num_stages=2, num_micro_batches=2,
                   actions=(good.actions[0], good.actions[1] + (Action.parse("F1"),)))
    with pytest.raises(ScheduleError, match=r"actions\[1\]\[4\]: duplicate: stage 1 already runs F1 at position 2"):
        validate_schedule(dup)
    w_without_split = Schedule(name="x", num_stages=1, num_micro_batches=1,
                               actions=(tuple(map(Action.parse, ["F0", "B0", "W0"])),))
    with pytest.raises(ScheduleError, match="W actions need split_backward=True"):
        validate_schedule(w_without_split)
    out_of_range = Schedule(name="x", num_stages=1, num_micro_batches=1,
                            actions=(tuple(map(Action.parse, ["F0", "B0", "F1"])),))
    with pytest.raises(ScheduleError, match=r"micro_batch must be < 1 and chunk < 1"):
        validate_schedule(out_of_range)


def test_negative_duration_rejected():
    with pytest.raises(ScheduleError, match="compute time must be a number >= 0 \\(got -1.0\\)"):
        simulate(one_f_one_b(2, 2), lambda s, a: -1.0)


def test_render_grid_unit_and_scaled():
    assert render_grid(one_f_one_b(2, 2)) == (
        "stage 0 | F0 F1    B0    B1\n"
        "stage 1 |    F0 B0 F1 B1"
    )
    sim = simulate(one_f_one_b(2, 2), f1_b2)
    assert render_grid(sim.schedule, sim) == (
        "stage 0 | F0 F1       B0 --    B1 --\n"
        "stage 1 |    F0 B0 -- F1 B1 --"
    )
    # Long schedules are squeezed to the requested width (in time steps).
    long = simulate(one_f_one_b(2, 64), unit)
    row = render_grid(long.schedule, long, width=40).splitlines()[0]
    assert len(row) <= len("stage 0 | ") + 40 * 4


def test_render_grid_shows_stuck_stages():
    text = render_grid(_deadlocked())
    assert text.splitlines()[-2:] == [
        "  stage 0 waits for B1 (needs B1 on stage 1)",
        "  stage 1 waits for F3 (needs F3 on stage 0)",
    ]

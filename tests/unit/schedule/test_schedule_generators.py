"""Schedule generators: exact orders (Megatron 1F1B/interleaved, ZB-H1), text form, actions."""

import pytest

from megatron_het.schedule import (
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    interleaved_table,
    one_f_one_b,
    validate_schedule,
    zero_bubble_h1,
)


def _text(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in acts) for acts in schedule.actions]


def test_action_str_and_parse():
    assert str(Action(kind="F", micro_batch=3)) == "F3"
    assert str(Action(kind="W", micro_batch=12, chunk=1)) == "W12.1"
    assert Action.parse("B3.1") == Action(kind="B", micro_batch=3, chunk=1)
    assert Action.parse("F0") == Action(kind="F", micro_batch=0, chunk=0)
    with pytest.raises(ScheduleError, match="action: not an action \\(got 'X3'\\)"):
        Action.parse("X3")
    with pytest.raises(ScheduleError, match="micro_batch must be an integer >= 0 \\(got -1\\)"):
        Action(kind="F", micro_batch=-1)


def test_one_f_one_b_order():
    s = one_f_one_b(3, 4)
    assert _text(s) == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert not s.split_backward and s.name == "1f1b"
    # Fewer micro-batches than stages: warm-up is capped at m.
    assert _text(one_f_one_b(4, 2))[0] == "F0 F1 B0 B1"


def test_gpipe_order():
    assert _text(gpipe(2, 3)) == ["F0 F1 F2 B0 B1 B2"] * 2


def test_interleaved_table_matches_megatron_docstring():
    # megatron-core schedules.py comment: PP2 N3M5 with VP2
    # microbatch_id 0 1 2 0 1 2 3 4 3 4 ; model_chunk_id 0 0 0 1 1 1 0 0 1 1
    table = interleaved_table(5, 2, 3)
    assert [m for m, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_interleaved_order_equals_megatron_core():
    # Derived by hand from forward_backward_pipelining_with_interleaving (megatron-core 0.19.2),
    # PP=2, VP=2, M=4, group size = PP = 2: warm-up = 2*(p-s-1) + (vp-1)*group forwards,
    # forward k = table[k], backward k = table[k] with chunk mirrored (vp-1-chunk).
    s = interleaved_1f1b(2, 4, 2)
    assert _text(s) == [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
    ]
    validate_schedule(s)


def test_interleaved_warmup_counts_and_constraints():
    s = interleaved_1f1b(4, 8, 2)
    for stage, acts in enumerate(s.actions):
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        # warm-up forwards, plus the steady state's first forward before the first backward
        assert first_b == 2 * (4 - stage - 1) + 4 + 1
    validate_schedule(s)
    with pytest.raises(ScheduleError, match=r"num_stages <= micro-batch group size <= num_micro_batches \(4 <= 4 <= 3\)"):
        interleaved_1f1b(4, 3, 2)
    with pytest.raises(ScheduleError, match="last micro-batch group has 2 micro-batches, fewer than num_stages 4"):
        interleaved_1f1b(4, 6, 2)


def test_zero_bubble_h1_order():
    s = zero_bubble_h1(3, 4)
    assert s.split_backward
    assert _text(s) == [
        "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3",
        "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3",
        "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3",
    ]
    validate_schedule(s)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (4, 4), (4, 9), (8, 16)])
def test_all_generators_valid_and_zb_h1_memory_not_above_1f1b(p, m):
    for s in (one_f_one_b(p, m), gpipe(p, m), zero_bubble_h1(p, m)):
        validate_schedule(s)
    assert zero_bubble_h1(p, m).peak_in_flight() == one_f_one_b(p, m).peak_in_flight()
    assert one_f_one_b(p, m).peak_in_flight() == tuple(min(p - s, m) for s in range(p))
    assert gpipe(p, m).peak_in_flight() == (m,) * p


def test_build_schedule_dispatch_and_errors():
    assert build_schedule("1f1b", 2, 4) == one_f_one_b(2, 4)
    assert build_schedule("interleaved", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    assert build_schedule("zb-h1", 3, 4).name == "zb-h1"
    assert build_schedule("gpipe", 3, 4).name == "gpipe"
    with pytest.raises(ScheduleError, match="schedule: unknown schedule name \\(got 'pipedream'\\).*1f1b, gpipe, interleaved, zb-h1"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ScheduleError, match="num_chunks: schedule '1f1b' runs one model chunk per stage, not 2"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="num_micro_batches must be an integer >= 1 \\(got 0\\)"):
        one_f_one_b(2, 0)


def test_text_round_trip():
    for s in (one_f_one_b(3, 5), interleaved_1f1b(2, 4, 2), zero_bubble_h1(3, 3)):
        text = s.to_text()
        assert text.splitlines()[0].startswith("stage 0: F0 ")
        back = Schedule.from_text(text, name=s.name)
        assert back == s
    with pytest.raises(ScheduleError, match="line 2: expected 'stage 1: ...'"):
        Schedule.from_text("stage 0: F0 B0\nstage 2: F0 B0\n")


def test_schedule_needs_one_list_per_stage():
    with pytest.raises(ScheduleError, match=r"expected one action list per stage \(3\), found 2"):
        Schedule(name="x", num_stages=3, num_micro_batches=1, actions=((), ()))

"""Per-rank GPipe and 1F1B schedules against literal tables written out by hand."""
import pytest

from dualframe.errors import ChunksError, ScheduleError
from dualframe.pipeline.schedule import (
    Action,
    bubble_fraction,
    check_link_order,
    clock_table,
    format_table,
    gpipe,
    link_messages,
    one_f_one_b,
    peak_live_activations,
    rank_schedule,
)


def lists(plans):
    return [" ".join(map(str, actions)) for actions in plans]


def grid(text):
    """A literal staircase (one line per tick, one column per stage, '.' idle) as a clock table."""
    return [[None if cell == "." else Action.parse(cell) for cell in line.split()] for line in text.strip().splitlines()]


def test_gpipe_lists_every_forward_then_backwards_in_reverse():
    assert lists(gpipe(3, 4)) == ["F0 F1 F2 F3 B3 B2 B1 B0"] * 3


def test_one_f_one_b_lists_warm_up_steady_cool_down():
    assert lists(one_f_one_b(4, 6)) == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]


def test_one_f_one_b_with_fewer_micro_batches_than_stages_is_gpipe_like():
    assert lists(one_f_one_b(3, 1)) == ["F0 B0"] * 3
    assert lists(one_f_one_b(3, 2)) == ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]


def test_gpipe_clock_is_the_staircase():
    assert clock_table(gpipe(3, 4)) == grid("""
        F0 .  .
        F1 F0 .
        F2 F1 F0
        F3 F2 F1
        .  F3 F2
        .  .  F3
        .  .  B3
        .  B3 B2
        B3 B2 B1
        B2 B1 B0
        B1 B0 .
        B0 .  .
    """)


def test_one_f_one_b_clock():
    assert clock_table(one_f_one_b(3, 4)) == grid("""
        F0 .  .
        F1 F0 .
        F2 F1 F0
        .  .  B0
        .  B0 F1
        B0 F2 B1
        F3 B1 F2
        B1 F3 B2
        .  B2 F3
        B2 .  B3
        .  B3 .
        B3 .  .
    """)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_bubble_is_n_minus_1_over_m_plus_n_minus_1(name, m):
    for n in (2, 3, 4):
        assert bubble_fraction(clock_table(rank_schedule(name, n, m))) == pytest.approx((n - 1) / (m + n - 1))


def test_one_f_one_b_keeps_at_most_stages_activations_alive():
    for n, m in [(2, 8), (4, 8), (4, 16), (3, 2)]:
        peaks = [peak_live_activations(actions) for actions in one_f_one_b(n, m)]
        assert peaks == [min(n - j, m) for j in range(n)]
        assert max(peaks) <= n
    assert [peak_live_activations(actions) for actions in gpipe(4, 8)] == [8, 8, 8, 8]


def test_a_schedule_that_cannot_finish_prints_the_grid_with_the_stuck_cells_marked():
    bad = [[Action.parse(a) for a in "F0 B0 F1 B1".split()], [Action.parse(a) for a in "F1 F0 B0 B1".split()]]
    with pytest.raises(ScheduleError) as error:
        clock_table(bad)
    assert str(error.value) == (
        "the schedule cannot finish: at tick 1 no stage can move (stage 0 for B0, stage 1 for F1; marked *):\n"
        "k\\j   0   1\n"
        "  0  F0   .\n"
        "  1 B0* F1*"
    )


def test_an_incomplete_list_is_refused_with_the_stage_named():
    with pytest.raises(ScheduleError, match=r"stage 1 must run F0..F1 and B0..B1 once each \(stage 1: F0 B0 B0 F1\)"):
        clock_table([gpipe(1, 2)[0], [Action.parse(a) for a in "F0 B0 B0 F1".split()]])
    with pytest.raises(ScheduleError, match=r"stage 1 runs B1 before F1 \(position 2\)"):
        clock_table([gpipe(1, 2)[0], [Action.parse(a) for a in "F0 B0 B1 F1".split()]])


def test_link_messages_follow_the_stage_order():
    assert [(m.tag, m.sender, m.receiver) for m in link_messages(one_f_one_b(3, 2), 1)] == [
        ("F0", 0, 1), ("F0", 1, 2), ("F1", 0, 1), ("F1", 1, 2),
        ("B0", 2, 1), ("B0", 1, 0), ("B1", 2, 1), ("B1", 1, 0),
    ]
    for name in ("gpipe", "1f1b"):
        check_link_order(rank_schedule(name, 4, 8))


def test_link_order_mismatch_is_refused():
    plans = [[Action.parse(a) for a in "F0 F1 B1 B0".split()], [Action.parse(a) for a in "F1 F0 B0 B1".split()]]
    with pytest.raises(ScheduleError, match=r"stages 0 and 1 would exchange F messages in different orders"):
        check_link_order(plans)


def test_bad_input_is_refused_with_the_rule():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        rank_schedule("zigzag", 2, 4)
    with pytest.raises(ChunksError, match=r"chunks must be an int >= 1 \(chunks: 0\)"):
        rank_schedule("gpipe", 2, 0)
    with pytest.raises(ScheduleError, match=r"stages must be an int >= 1 \(stages: 0\)"):
        one_f_one_b(0, 2)
    with pytest.raises(ScheduleError, match=r"an action is F<micro-batch> or B<micro-batch> \(action: 'X1'\)"):
        Action.parse("X1")


def test_format_table_shows_idle_cells_as_dots():
    assert format_table(clock_table(gpipe(2, 1))) == "k\\j   0   1\n  0  F0   .\n  1   .  F0\n  2   .  B0\n  3  B0   ."

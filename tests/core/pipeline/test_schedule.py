"""Schedules against literal staircases written out by hand: per-rank action lists (GPipe, 1F1B), their
clock tables, the one-process passes cut from them, and the registry a new schedule joins."""
import pytest

import dualframe
from dualframe.errors import ChunksError, ScheduleError
from dualframe.pipeline.action import Action
from dualframe.pipeline.clock import (
    check_rows,
    clock_table,
    format_grid,
    format_table,
    gpipe_bubble,
    grid_rows,
    pass_ticks,
    peak_live_activations,
    table_bubble,
)
from dualframe.pipeline.link_order import check_link_order, link_messages
from dualframe.pipeline.schedule import (
    gpipe,
    one_f_one_b,
    one_process,
    one_process_ticks,
    rank_schedule,
    register,
    registered,
    schedule_names,
    unregister,
)

_ = "."


def lists(action_lists):
    return [" ".join(map(str, actions)) for actions in action_lists]


def rows(m, n, kind):
    """The one-process GPipe pass ``kind`` as a tick x stage grid of labels."""
    return grid_rows(one_process_ticks("gpipe", m, n, kind), n, kind)


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
        assert table_bubble(clock_table(rank_schedule(name, n, m))) == pytest.approx((n - 1) / (m + n - 1))
        assert gpipe_bubble(n, m) == pytest.approx((n - 1) / (m + n - 1))


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
    bad = [[Action.parse(a) for a in "F0 F1 B1 B0".split()], [Action.parse(a) for a in "F1 F0 B0 B1".split()]]
    with pytest.raises(ScheduleError, match=r"stages 0 and 1 would exchange F messages in different orders"):
        check_link_order(bad)


def test_bad_input_is_refused_with_the_rule():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        rank_schedule("zigzag", 2, 4)
    with pytest.raises(ChunksError, match=r"chunks must be an int >= 1 \(chunks: 0\)"):
        rank_schedule("gpipe", 2, 0)
    with pytest.raises(ScheduleError, match=r"stages must be an int >= 1 \(stages: 0\)"):
        one_f_one_b(0, 2)
    with pytest.raises(ScheduleError, match=r"an action is F<micro-batch>, B<micro-batch> or W<micro-batch> \(action: 'X1'\)"):
        Action.parse("X1")


def test_format_table_shows_idle_cells_as_dots():
    assert format_table(clock_table(gpipe(2, 1))) == "k\\j   0   1\n  0  F0   .\n  1   .  F0\n  2   .  B0\n  3  B0   ."


# The one-process passes: GPipe's forward and backward ticks, cut from its clock table.


def test_forward_staircase_4_chunks_3_stages():
    check_rows(rows(4, 3, "F"), [
        ["F0", _, _],
        ["F1", "F0", _],
        ["F2", "F1", "F0"],
        ["F3", "F2", "F1"],
        [_, "F3", "F2"],
        [_, _, "F3"],
    ])


def test_backward_is_the_mirror_4_chunks_3_stages():
    check_rows(rows(4, 3, "B"), [
        [_, _, "B3"],
        [_, "B3", "B2"],
        ["B3", "B2", "B1"],
        ["B2", "B1", "B0"],
        ["B1", "B0", _],
        ["B0", _, _],
    ])


def test_more_stages_than_chunks_2_chunks_4_stages():
    check_rows(rows(2, 4, "F"), [
        ["F0", _, _, _],
        ["F1", "F0", _, _],
        [_, "F1", "F0", _],
        [_, _, "F1", "F0"],
        [_, _, _, "F1"],
    ])


def test_single_stage_and_single_chunk():
    check_rows(rows(3, 1, "F"), [["F0"], ["F1"], ["F2"]])
    check_rows(rows(1, 3, "B"), [[_, _, "B0"], [_, "B0", _], ["B0", _, _]])


def test_every_cell_exactly_once_and_dependencies_respected():
    for m in range(1, 6):
        for n in range(1, 5):
            for kind in ("F", "B"):
                seen = {}
                for k, tick in enumerate(one_process_ticks("gpipe", m, n, kind)):
                    for cell in tick:
                        assert cell not in seen
                        seen[cell] = k
                assert sorted(seen) == [(i, j) for i in range(m) for j in range(n)]
                step = 1 if kind == "F" else -1
                for (i, j), k in seen.items():
                    if 0 <= j - step < n:
                        assert seen[(i, j - step)] < k  # the stage before it in this pass ran earlier


def test_mismatch_prints_the_grid_with_the_failing_cell_marked():
    wrong = [["F0", _], ["F1", "F1"], [_, "F1"]]
    with pytest.raises(ScheduleError) as info:
        check_rows(rows(2, 2, "F"), wrong)
    message = str(info.value)
    assert "tick 1, stage 1 (got F0, expected F1)" in message
    assert "   1 | F1      | >F0<" in message


def test_bubble_formula_and_bad_arguments():
    assert gpipe_bubble(stages=4, chunks=4) == pytest.approx(3 / 7)
    assert table_bubble(clock_table(gpipe(4, 4))) == pytest.approx(3 / 7)
    with pytest.raises(ChunksError, match=r"chunks must be an int >= 1 \(chunks: 0\)"):
        one_process_ticks("gpipe", 0, 2, "F")
    with pytest.raises(ScheduleError, match=r"stages must be an int >= 1 \(stages: -1\)"):
        one_process_ticks("gpipe", 2, -1, "F")
    with pytest.raises(ScheduleError, match=r"kind must be one of F, B \(kind: 'X'\)"):
        one_process_ticks("gpipe", 2, 2, "X")
    with pytest.raises(ScheduleError, match="stage 0 has two cells at tick 0"):
        grid_rows([[(0, 0), (1, 0)]], 2)


def test_one_process_ticks_are_the_clock_tables_passes_made_once():
    assert one_process_ticks("gpipe", 3, 2, "B") == pass_ticks(clock_table(gpipe(2, 3)), "B")
    assert one_process_ticks("gpipe", 3, 2, "B") is one_process_ticks("GPipe", 3, 2, "B")


def test_format_grid_without_mark():
    assert format_grid([["F0", "."]]) == "tick | stage 0 | stage 1\n   0 | F0      | ."


# The registry: a new schedule joins in one place, and every name check reads it.


def fifo_gpipe(stages, chunks):
    """GPipe with backwards in forward order (F0 F1 B0 B1): a toy schedule to register."""
    return [sorted(actions, key=lambda a: (a.kind == "B", a.micro)) for actions in gpipe(stages, chunks)]


def interleaved(stages, chunks):
    """1F1B under another name, wrongly claimed runnable by one process."""
    return one_f_one_b(stages, chunks)


@pytest.fixture
def toy():
    register("fifo", fifo_gpipe, one_process=True)
    yield "fifo"
    unregister("fifo")


def test_the_registry_holds_gpipe_1f1b_zb_h1_and_says_which_one_process_runs():
    assert schedule_names() == ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
    assert schedule_names(one_process=True) == ("gpipe",)
    assert schedule_names(virtual=True) == ("interleaved-1f1b", "zb-v")
    assert registered("1F1B").build is one_f_one_b and registered("gpipe").build is gpipe


def test_a_registered_schedule_is_accepted_everywhere_from_that_one_call(toy):
    assert dualframe.Pipeline([1, 1], chunks=2, schedule="FIFO").schedule == "fifo"
    assert lists(rank_schedule("fifo", 2, 2)) == ["F0 F1 B0 B1"] * 2
    check_rows(grid_rows(one_process_ticks("fifo", 2, 2, "B"), 2, "B"), [
        [_, "B0"],
        ["B0", "B1"],
        ["B1", _],
    ])
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b, zb-h1, interleaved-1f1b, zb-v, fifo"):
        dualframe.Pipeline([1, 1], schedule="zigzag")


def test_registering_is_checked():
    with pytest.raises(ScheduleError, match=r"schedule 'gpipe' is already registered; choose another name"):
        register("gpipe", gpipe, one_process=True)
    with pytest.raises(ScheduleError, match=r"a schedule name is a non-empty lower-case string \(name: 'ZB'\)"):
        register("ZB", gpipe, one_process=True)
    with pytest.raises(ScheduleError, match=r"schedule 'zb': say in why_not why the one-process Pipeline"):
        register("zb", gpipe, one_process=False)


def test_one_process_refuses_1f1b_by_name_with_the_reason_and_what_to_use():
    with pytest.raises(ScheduleError) as error:
        one_process("1f1b")
    message = str(error.value)
    assert message.startswith("the one-process Pipeline cannot run schedule '1f1b': 1f1b interleaves backward "
                              "with forward (B0 runs before the last forward), which needs the loss inside the "
                              "pipeline")
    assert message.endswith("use schedule='gpipe' here, or DistributedPipeline(..., schedule='1f1b', loss_fn=...), "
                            "which holds the loss")
    with pytest.raises(ScheduleError, match="cannot run schedule '1f1b'"):
        one_process_ticks("1f1b", 4, 2, "F")
    assert one_process("GPipe").name == "gpipe"


def test_a_table_that_mixes_the_passes_has_no_one_process_ticks():
    register("mixed", interleaved, one_process=True)
    try:
        with pytest.raises(ScheduleError) as error:
            one_process_ticks("mixed", 3, 2, "F")
    finally:
        unregister("mixed")
    assert str(error.value) == (
        "a forward runs at tick 3, after the first backward (tick 2), so the table has no separate forward and "
        "backward pass (marked *):\n"
        "k\\j   0   1\n"
        "  0  F0   .\n"
        "  1  F1  F0\n"
        "  2   .  B0\n"
        "  3  B0 F1*\n"
        "  4  F2  B1\n"
        "  5  B1  F2\n"
        "  6   .  B2\n"
        "  7  B2   ."
    )

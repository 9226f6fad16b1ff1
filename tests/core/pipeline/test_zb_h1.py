"""ZB-H1 (zero-bubble, backward split into B and W) against literal staircases written out by hand: its lists,
its clock tables, its bubble and its memory against 1F1B's, and how the clock and the link order read W."""
import pytest

from dualframe.errors import ScheduleError
from dualframe.pipeline.action import Action, splits_backward
from dualframe.pipeline.clock import clock_table, gpipe_bubble, peak_live_activations, table_bubble, zb_h1_bubble
from dualframe.pipeline.link_order import check_link_order, link_messages
from dualframe.pipeline.schedule import one_f_one_b, one_process, rank_schedule, registered, zb_h1


def lists(action_lists):
    return [" ".join(map(str, actions)) for actions in action_lists]


def grid(text):
    """A literal staircase (one line per tick, one column per stage, '.' idle) as a clock table."""
    return [[None if cell == "." else Action.parse(cell) for cell in line.split()] for line in text.strip().splitlines()]


def parse(text):
    return [Action.parse(a) for a in text.split()]


def test_zb_h1_lists_are_1f1b_with_w_after_b_delayed_by_the_stage_index():
    assert lists(zb_h1(2, 4)) == [
        "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
        "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3",
    ]
    assert lists(rank_schedule("zb-h1", 4, 8)) == [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ]
    assert lists(zb_h1(3, 1)) == ["F0 B0 W0"] * 3


def test_zb_h1_clock_2_stages_4_micro_batches():
    assert clock_table(zb_h1(2, 4)) == grid("""
        F0 .
        F1 F0
        .  B0
        B0 F1
        W0 B1
        F2 W0
        B1 F2
        W1 B2
        F3 W1
        B2 F3
        W2 B3
        B3 W2
        W3 W3
    """)


def test_zb_h1_clock_4_stages_8_micro_batches():
    assert clock_table(zb_h1(4, 8)) == grid("""
        F0 .  .  .
        F1 F0 .  .
        F2 F1 F0 .
        F3 F2 F1 F0
        .  .  .  B0
        .  .  B0 F1
        .  B0 F2 B1
        B0 F3 B1 F2
        W0 B1 F3 B2
        F4 W0 B2 F3
        B1 F4 W0 B3
        W1 B2 F4 W0
        F5 W1 B3 F4
        B2 F5 W1 B4
        W2 B3 F5 W1
        F6 W2 B4 F5
        B3 F6 W2 B5
        W3 B4 F6 W2
        F7 W3 B5 F6
        B4 F7 W3 B6
        W4 B5 F7 W3
        B5 W4 B6 F7
        W5 B6 W4 B7
        B6 W5 B7 W4
        W6 B7 W5 W5
        B7 W6 W6 W6
        W7 W7 W7 W7
    """)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32])
def test_zb_h1_bubble_is_n_minus_1_over_3m_plus_n_minus_1_a_third_of_1f1b(n, m):
    table = clock_table(rank_schedule("zb-h1", n, m))
    if m >= n:
        assert table_bubble(table) == pytest.approx(zb_h1_bubble(n, m))
        assert len(table) == 3 * m + n - 1  # every stage idle n - 1 ticks, as many as the pipeline is deep
    # 1F1B with its backward as long as B + W (two ticks): the same idle share as with one-tick cells.
    assert table_bubble(table) < gpipe_bubble(n, m) or n == 1
    assert table_bubble(table) <= table_bubble(clock_table(one_f_one_b(n, m)))


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (4, 16), (3, 2), (8, 8), (4, 1)])
def test_zb_h1_activation_memory_is_no_more_than_1f1b(n, m):
    zb, ofob = zb_h1(n, m), one_f_one_b(n, m)
    # What a B frees (the activations of the stage's forward) peaks on each stage exactly as in 1F1B ...
    assert [peak_live_activations(a) for a in zb] == [peak_live_activations(a) for a in ofob]
    # ... and what a W still reads is held by at most n micro-batches on any stage: 1F1B's first stage's peak.
    assert max(peak_live_activations(a, held_until="W") for a in zb) == max(peak_live_activations(a) for a in ofob)
    assert [peak_live_activations(a, "W") for a in zb] == [min(n, m)] * n


def test_the_registry_holds_zb_h1_for_processes_and_refuses_it_in_one_process():
    assert not registered("ZB-H1").one_process
    with pytest.raises(ScheduleError, match=r"the one-process Pipeline cannot run schedule 'zb-h1': zb-h1 interleaves"):
        one_process("zb-h1")


def test_w_stays_on_its_stage_and_neighbours_agree_on_the_order():
    assert [(msg.tag, msg.sender, msg.receiver) for msg in link_messages(zb_h1(2, 2), 0)] == [
        ("F0", 0, 1), ("F1", 0, 1), ("B0", 1, 0), ("B1", 1, 0),
    ]
    for n, m in [(2, 4), (4, 8), (3, 5)]:
        check_link_order(zb_h1(n, m))
    assert splits_backward(zb_h1(2, 2)[0]) and not splits_backward(one_f_one_b(2, 2)[0])


def test_w_waits_for_its_own_stage_b_and_a_list_must_hold_every_w_or_none():
    with pytest.raises(ScheduleError, match=r"stage 0 runs W0 before B0 \(position 1\)"):
        clock_table([parse("F0 W0 B0")])
    with pytest.raises(ScheduleError, match=r"stage 1 must run F0..F1, B0..B1 and W0..W1 once each \(stage 1: F0 B0 F1 B1\)"):
        clock_table([parse("F0 B0 W0 F1 B1 W1"), parse("F0 B0 F1 B1")])
    with pytest.raises(ScheduleError, match=r"held_until must be one of B, W \(held_until: 'F'\)"):
        peak_live_activations(parse("F0 B0"), held_until="F")


def test_a_process_pipeline_whose_adapter_cannot_split_the_backward_refuses_zb_h1_before_communicating():
    from dualframe.pipeline.graph import chain_split
    from dualframe.pipeline.layout import layout_pipeline
    from dualframe.pipeline.stage import open_stage

    class NoSplit:
        name, split_backward = "tensorflow", False

        def __getattr__(self, attribute):
            raise AssertionError(f"the refusal must come before any use of the backend ({attribute})")

    layout = layout_pipeline(4, [2, 2], chunks=4, schedule="zb-h1", world=2)
    with pytest.raises(ScheduleError, match=r"schedule 'zb-h1' splits the backward into B \(input gradient\) and W "
                                            r"\(weight gradient\), which tensorflow's process pipeline does not run "
                                            r"yet; use schedule='1f1b' or 'gpipe' here"):
        open_stage(NoSplit(), layout, split=chain_split(2))

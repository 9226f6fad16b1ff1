"""GPipe with batched weight gradients as a core transform (schedule.batched_weights), laid on the clock."""
import pytest

from dualframe.errors import ScheduleError
from dualframe.pipeline.action import Action
from dualframe.pipeline.clock import clock_table, table_bubble
from dualframe.pipeline.schedule import (batched_weights, deferred_weights, forwards_first, fused_last_stage, gpipe,
                                         one_f_one_b, rank_schedule, schedule_names)


def _rows(table):
    return [" ".join(str(cell or ".") for cell in row) for row in table]


def test_batched_gpipe_runs_every_w_after_the_last_b_in_the_bs_order():
    lists = batched_weights(gpipe(2, 3))
    assert [" ".join(map(str, a)) for a in lists] == ["F0 F1 F2 B2 B1 B0 W2 W1 W0"] * 2
    assert _rows(clock_table(lists)) == [
        "F0 .", "F1 F0", "F2 F1", ". F2", ". B2", "B2 B1", "B1 B0", "B0 W2", "W2 W1", "W1 W0", "W0 ."]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_batched_gpipe_finishes_for_every_size_and_adds_m_ticks_of_w(n, m):
    plain, batched = clock_table(gpipe(n, m)), clock_table(batched_weights(gpipe(n, m)))
    assert len(batched) == len(plain) + m  # rank 0's W's follow its last B; no other rank waits for them
    for r in range(n):
        column = [row[r] for row in batched if row[r] is not None]
        assert [a for a in column if a.kind != "W"] == gpipe(n, m)[r]
        assert [a.micro for a in column if a.kind == "W"] == list(reversed(range(m)))


def test_a_rank_alone_may_take_the_transform_since_w_sends_nothing():
    plain, batched = gpipe(3, 4), batched_weights(gpipe(3, 4))
    for r in range(3):
        assert deferred_weights(plain[r]) == batched[r]


def test_lists_with_w_already_are_refused():
    with pytest.raises(ScheduleError, match=r"deferred_weights adds W actions to a schedule without them"):
        batched_weights(rank_schedule("zb-h1", 2, 4))


def test_a_transform_that_cannot_finish_prints_the_grid():
    stuck = [[Action.parse(a) for a in "F0 B0 F1 B1".split()], [Action.parse(a) for a in "F1 F0 B0 B1".split()]]
    with pytest.raises(ScheduleError, match=r"cannot finish") as caught:
        batched_weights(stuck)
    assert "B0* F1*" in str(caught.value)


def test_only_schedules_running_every_forward_first_batch_their_weights():
    assert forwards_first(gpipe(4, 8)) and not forwards_first(one_f_one_b(4, 8))
    assert [name for name in schedule_names(virtual=False)
            if forwards_first(rank_schedule(name, 3, 6))] == ["gpipe"]
    assert not forwards_first(rank_schedule("interleaved-1f1b", 2, 4, virtual_stages=2))
    assert table_bubble(clock_table(batched_weights(gpipe(2, 8)))) < table_bubble(clock_table(gpipe(2, 8))) + 0.2
    assert _rows(clock_table(batched_weights(gpipe(1, 1)))) == ["F0", "B0", "W0"]


def test_fused_last_stage_runs_each_backward_after_its_forward_there_and_ascending_elsewhere():
    lists = fused_last_stage(batched_weights(gpipe(2, 3)))
    assert [" ".join(map(str, a)) for a in lists] == ["F0 F1 F2 B0 B1 B2 W2 W1 W0", "F0 B0 F1 B1 F2 B2 W2 W1 W0"]
    assert _rows(clock_table(lists)) == [
        "F0 .", "F1 F0", "F2 B0", "B0 F1", ". B1", "B1 F2", ". B2", "B2 W2", "W2 W1", "W1 W0", "W0 ."]
    assert [" ".join(map(str, a)) for a in fused_last_stage(gpipe(1, 2))] == ["F0 B0 F1 B1"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_fused_last_stage_keeps_every_action_and_finishes(n, m):
    for lists in (gpipe(n, m), batched_weights(gpipe(n, m))):
        fused = fused_last_stage(lists)
        assert [sorted(a) for a in fused] == [sorted(a) for a in lists]
        assert len(clock_table(fused)) <= len(clock_table(lists)) + 1
        assert [a for a in fused[-1] if a.kind != "W"] == [a for i in range(m) for a in gpipe(1, m)[0] if a.micro == i]


def test_fused_last_stage_refuses_lists_that_interleave_backward_with_forward():
    with pytest.raises(ScheduleError, match=r"fused_last_stage reorders lists that run every forward first"):
        fused_last_stage(one_f_one_b(2, 4))

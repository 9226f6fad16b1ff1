"""The GPipe clock-tick schedule against literal staircases, and the walker that runs it."""
import threading
import time

import pytest

from dualframe.errors import ChunksError, ScheduleError, StageError
from dualframe.pipeline.clock import (GPipeSchedule, cached_ticks, check_rows, format_grid, grid_rows, lane_groups,
                                run_ticks)

_ = "."


def test_forward_staircase_4_chunks_3_stages():
    check_rows(GPipeSchedule(chunks=4, stages=3).rows("F"), [
        ["F0", _, _],
        ["F1", "F0", _],
        ["F2", "F1", "F0"],
        ["F3", "F2", "F1"],
        [_, "F3", "F2"],
        [_, _, "F3"],
    ])


def test_backward_is_the_mirror_4_chunks_3_stages():
    check_rows(GPipeSchedule(chunks=4, stages=3).rows("B"), [
        [_, _, "B3"],
        [_, "B3", "B2"],
        ["B3", "B2", "B1"],
        ["B2", "B1", "B0"],
        ["B1", "B0", _],
        ["B0", _, _],
    ])


def test_more_stages_than_chunks_2_chunks_4_stages():
    check_rows(GPipeSchedule(chunks=2, stages=4).rows("F"), [
        ["F0", _, _, _],
        ["F1", "F0", _, _],
        [_, "F1", "F0", _],
        [_, _, "F1", "F0"],
        [_, _, _, "F1"],
    ])


def test_single_stage_and_single_chunk():
    check_rows(GPipeSchedule(chunks=3, stages=1).rows("F"), [["F0"], ["F1"], ["F2"]])
    check_rows(GPipeSchedule(chunks=1, stages=3).rows("B"), [[_, _, "B0"], [_, "B0", _], ["B0", _, _]])


def test_every_cell_exactly_once_and_dependencies_respected():
    for m in range(1, 6):
        for n in range(1, 5):
            schedule = GPipeSchedule(m, n)
            for kind in ("F", "B"):
                seen = {}
                for k, tick in enumerate(schedule.ticks(kind)):
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
        check_rows(GPipeSchedule(2, 2).rows("F"), wrong)
    message = str(info.value)
    assert "tick 1, stage 1 (got F0, expected F1)" in message
    assert "   1 | F1      | >F0<" in message


def test_bubble_formula_and_bad_arguments():
    assert GPipeSchedule(4, 4).bubble == pytest.approx(3 / 7)
    with pytest.raises(ChunksError, match=r"chunks must be an int >= 1 \(chunks: 0\)"):
        GPipeSchedule(0, 2)
    with pytest.raises(ScheduleError, match=r"stages must be an int >= 1 \(stages: -1\)"):
        GPipeSchedule(2, -1)
    with pytest.raises(ScheduleError, match="stage 0 has two cells at tick 0"):
        grid_rows([[(0, 0), (1, 0)]], 2)


def test_walker_runs_ticks_in_order_and_cells_of_a_tick_concurrently():
    schedule = GPipeSchedule(3, 3)
    order, lock = [], threading.Lock()
    barrier = threading.Barrier(3, timeout=5)

    def cell(i, j):
        if i + j == 2:  # the full tick: all three cells must be running at once to pass the barrier
            barrier.wait()
        with lock:
            order.append((i, j))

    records = []
    run_ticks(schedule.ticks("F"), cell, 3, record=lambda *r: records.append(r))
    ticks = [i + j for i, j in order]
    assert ticks == sorted(ticks)
    assert len(records) == 9 and all(r[0] == "F" and r[3] <= r[4] for r in records)


def test_lane_groups_put_cells_of_one_device_together_in_tick_order():
    tick = GPipeSchedule(4, 4).ticks("F")[3]  # (0, 3), (1, 2), (2, 1), (3, 0)
    assert lane_groups(tick) == [[(0, 3)], [(1, 2)], [(2, 1)], [(3, 0)]]
    assert lane_groups(tick, ["a", "a", "b", "b"]) == [[(0, 3), (1, 2)], [(2, 1), (3, 0)]]
    assert lane_groups(tick, ["cpu"] * 4) == [[(0, 3), (1, 2), (2, 1), (3, 0)]]


@pytest.mark.parametrize("lanes, threads", [(["a", "a", "b", "b"], 2), (["cpu"] * 4, 1)])
def test_walker_runs_one_thread_per_lane_in_schedule_order(lanes, threads):
    seen, order, lock = {}, [], threading.Lock()
    barrier = threading.Barrier(2, timeout=5)

    def cell(i, j):
        if threads == 2 and (i, j) in ((0, 3), (2, 1)):  # each lane's first cell at tick 3: both at once
            barrier.wait()
        with lock:
            seen.setdefault((i + j, lanes[j]), set()).add(threading.get_ident())
            order.append((i, j))

    run_ticks(GPipeSchedule(4, 4).ticks("F"), cell, 4, lanes=lanes)
    assert [i + j for i, j in order] == sorted(i + j for i, j in order)
    assert all(len(ids) == 1 for ids in seen.values())  # the cells of a lane in a tick share one thread
    if threads == 1:  # one lane: every cell in the calling thread, in schedule order
        assert set().union(*seen.values()) == {threading.get_ident()}
        assert order == [c for tick in GPipeSchedule(4, 4).ticks("F") for c in tick]


def test_cached_ticks_equal_the_schedule_and_are_made_once():
    assert cached_ticks(3, 2, "B") == tuple(tuple(t) for t in GPipeSchedule(3, 2).ticks("B"))
    assert cached_ticks(3, 2, "B") is cached_ticks(3, 2, "B")


def test_walker_failure_names_the_cell_and_marks_it():
    def cell(i, j):
        if (i, j) == (1, 1):
            raise ValueError("shape mismatch")
        time.sleep(0.001)

    with pytest.raises(StageError) as info:
        run_ticks(GPipeSchedule(3, 2).ticks("F"), cell, 2)
    error = info.value
    assert (error.micro_batch, error.stage, error.tick) == (1, 1, 2)
    assert "stage 1 failed on micro-batch 1 (F1 at tick 2): ValueError: shape mismatch" in str(error)
    assert "   2 | F2      | >F1<" in str(error)
    assert isinstance(error.__cause__, ValueError)


def test_format_grid_without_mark():
    assert format_grid([["F0", "."]]) == "tick | stage 0 | stage 1\n   0 | F0      | ."

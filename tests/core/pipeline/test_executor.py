"""The one-process executor: runs a schedule's ticks in order, the cells of a tick in threads, one per lane."""
import threading
import time

import pytest

from dualframe.errors import StageError
from dualframe.pipeline.executor import lane_groups, run_ticks
from dualframe.pipeline.schedule import one_process_ticks


def gpipe_ticks(m, n, kind="F"):
    return one_process_ticks("gpipe", m, n, kind)


def test_walker_runs_ticks_in_order_and_cells_of_a_tick_concurrently():
    order, lock = [], threading.Lock()
    barrier = threading.Barrier(3, timeout=5)

    def cell(i, j):
        if i + j == 2:  # the full tick: all three cells must be running at once to pass the barrier
            barrier.wait()
        with lock:
            order.append((i, j))

    records = []
    run_ticks(gpipe_ticks(3, 3), cell, 3, record=lambda *r: records.append(r))
    ticks = [i + j for i, j in order]
    assert ticks == sorted(ticks)
    assert len(records) == 9 and all(r[0] == "F" and r[3] <= r[4] for r in records)


def test_lane_groups_put_cells_of_one_device_together_in_tick_order():
    tick = gpipe_ticks(4, 4)[3]  # (0, 3), (1, 2), (2, 1), (3, 0)
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

    run_ticks(gpipe_ticks(4, 4), cell, 4, lanes=lanes)
    assert [i + j for i, j in order] == sorted(i + j for i, j in order)
    assert all(len(ids) == 1 for ids in seen.values())  # the cells of a lane in a tick share one thread
    if threads == 1:  # one lane: every cell in the calling thread, in schedule order
        assert set().union(*seen.values()) == {threading.get_ident()}
        assert order == [c for tick in gpipe_ticks(4, 4) for c in tick]


def test_walker_failure_names_the_cell_and_marks_it():
    def cell(i, j):
        if (i, j) == (1, 1):
            raise ValueError("shape mismatch")
        time.sleep(0.001)

    with pytest.raises(StageError) as info:
        run_ticks(gpipe_ticks(3, 2), cell, 2)
    error = info.value
    assert (error.micro_batch, error.stage, error.tick) == (1, 1, 2)
    assert "stage 1 failed on micro-batch 1 (F1 at tick 2): ValueError: shape mismatch" in str(error)
    assert "   2 | F2      | >F1<" in str(error)
    assert isinstance(error.__cause__, ValueError)

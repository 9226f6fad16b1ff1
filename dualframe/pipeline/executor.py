"""Runs the cells of a one-process pipeline pass tick by tick, the cells of a tick in threads, one per lane.

The ticks come from the schedule module (``dualframe.pipeline.schedule.one_process_ticks``): the cells
``(i, j)`` (micro-batch i on stage j) of one pass per clock tick, laid out by ``clock_table`` from a
registered schedule's action lists. Adapters hand ``run_ticks`` a function that executes one cell;
cells of one tick are independent (they touch different stages) and may run at the same time, one
thread per lane (device).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Hashable, List, Optional, Sequence

from dualframe.errors import StageError
from dualframe.pipeline.action import Cell
from dualframe.pipeline.clock import format_grid, grid_rows

#: What a cell runner returns nothing from; it is called as ``cell(i, j)``.
CellFn = Callable[[int, int], None]
#: Called after each cell with (kind, i, j, start, end) in ``time.perf_counter`` seconds.
RecordFn = Callable[[str, int, int, float, float], None]


def run_ticks(
    ticks: Sequence[Sequence[Cell]],
    cell: CellFn,
    stages: int,
    kind: str = "F",
    parallel: bool = True,
    record: Optional[RecordFn] = None,
    lanes: Optional[Sequence[Hashable]] = None,
) -> None:
    """Run every cell tick by tick; the cells of one tick run in threads when ``parallel``.

    A tick finishes before the next begins, so a cell always sees its inputs from the tick before.
    ``lanes[j]`` names the lane of stage j (its device): the cells of one tick that share a lane run
    one after another in one thread, since a device runs one thing at a time; cells in different
    lanes run in threads. ``None``: every stage its own lane. One lane per tick: no thread at all.

    Raises:
        StageError: a cell raised; the message shows the tick x stage grid with that cell marked,
            and the original exception is chained as ``__cause__``.
    """
    groups = [lane_groups(tick, lanes) for tick in ticks]
    threads = max((len(tick) for tick in groups), default=1)
    pool = ThreadPoolExecutor(max_workers=threads) if parallel and threads > 1 else None
    try:
        for k, tick in enumerate(groups):
            if pool is None or len(tick) == 1:
                for lane in tick:
                    _run_lane(lane, cell, kind, record, ticks, stages, k)
                continue
            # All lanes but the last go to the pool; the calling thread runs the last one itself.
            futures: List[Future] = [pool.submit(_run_lane, lane, cell, kind, record, ticks, stages, k)
                                     for lane in tick[:-1]]
            errors: List[Optional[BaseException]] = []
            try:
                _run_lane(tick[-1], cell, kind, record, ticks, stages, k)
            except StageError as error:
                errors.append(error)
            errors = [f.exception() for f in futures] + errors
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
    finally:
        if pool is not None:
            pool.shutdown(wait=True)


def lane_groups(tick: Sequence[Cell], lanes: Optional[Sequence[Hashable]] = None) -> List[List[Cell]]:
    """The cells of one tick grouped by the lane of their stage, in order of first appearance.

    Example:
        >>> lane_groups([(0, 2), (1, 1), (2, 0)], ["cuda:0", "cuda:0", "cuda:1"])
        [[(0, 2)], [(1, 1), (2, 0)]]
    """
    if lanes is None:
        return [[c] for c in tick]
    grouped: Dict[Hashable, List[Cell]] = {}
    for i, j in tick:
        grouped.setdefault(lanes[j], []).append((i, j))
    return list(grouped.values())


def _run_lane(lane: Sequence[Cell], cell: CellFn, kind: str, record: Optional[RecordFn],
              ticks: Sequence[Sequence[Cell]], stages: int, k: int) -> None:
    for i, j in lane:
        _timed(cell, i, j, kind, record, ticks, stages, k)


def _timed(cell: CellFn, i: int, j: int, kind: str, record: Optional[RecordFn],
           ticks: Sequence[Sequence[Cell]], stages: int, k: int) -> None:
    start = time.perf_counter()
    try:
        cell(i, j)
    except StageError:
        raise
    except Exception as error:
        grid = format_grid(grid_rows(ticks, stages, kind), (k, j))
        raise StageError(
            f"stage {j} failed on micro-batch {i} ({kind}{i} at tick {k}): "
            f"{type(error).__name__}: {error}\n{grid}",
            micro_batch=i, stage=j, tick=k,
        ) from error
    if record is not None:
        record(kind, i, j, start, time.perf_counter())

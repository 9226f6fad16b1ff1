"""The GPipe clock-tick schedule as data (which cells run at each tick) and the walker that runs it.

Index names, fixed everywhere in this module: ``i`` micro-batch, ``j`` stage, ``k`` clock tick,
``m`` micro-batches (``chunks``), ``n`` stages. A cell ``(i, j)`` is "stage j on micro-batch i".

Forward: at tick ``k`` the cells with ``i + j == k`` run, so ``m + n - 1`` ticks make the staircase::

    tick | stage 0 | stage 1
       0 | F0      | .
       1 | F1      | F0
       2 | .       | F1

Backward is its mirror: at tick ``k`` the cells with ``(m - 1 - i) + (n - 1 - j) == k``.
Adapters hand ``run_ticks`` a function that executes one cell; cells of one tick are independent
(they touch different stages) and may run at the same time, one thread per lane (device).
"""
from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from dualframe.errors import ScheduleError, StageError
from dualframe.pipeline.microbatch import validate_chunks

Cell = Tuple[int, int]
Ticks = List[List[Cell]]
KINDS = ("F", "B")


def forward_ticks(chunks: int, stages: int) -> Ticks:
    """Cells per clock tick for the forward pass: tick k holds (i, k - i), i ascending.

    Example:
        >>> forward_ticks(2, 2)
        [[(0, 0)], [(0, 1), (1, 0)], [(1, 1)]]
    """
    m, n = validate_chunks(chunks), _stages(stages)
    return [[(i, k - i) for i in range(max(0, k - n + 1), min(k, m - 1) + 1)] for k in range(m + n - 1)]


def backward_ticks(chunks: int, stages: int) -> Ticks:
    """Cells per clock tick for the backward pass: the forward staircase mirrored.

    Example:
        >>> backward_ticks(2, 2)
        [[(1, 1)], [(1, 0), (0, 1)], [(0, 0)]]
    """
    m, n = validate_chunks(chunks), _stages(stages)
    return [[(m - 1 - i, n - 1 - j) for i, j in tick] for tick in forward_ticks(m, n)]


def _stages(stages: int) -> int:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ScheduleError(f"stages must be an int >= 1 (stages: {stages!r})")
    return stages


@dataclass(frozen=True)
class GPipeSchedule:
    """The GPipe schedule for ``chunks`` micro-batches through ``stages`` stages.

    Example:
        >>> schedule = GPipeSchedule(chunks=3, stages=2)
        >>> schedule.rows("F")
        [['F0', '.'], ['F1', 'F0'], ['F2', 'F1'], ['.', 'F2']]
        >>> round(schedule.bubble, 3)
        0.25
    """

    chunks: int
    stages: int

    def __post_init__(self) -> None:
        validate_chunks(self.chunks)
        _stages(self.stages)

    def ticks(self, kind: str = "F") -> Ticks:
        """Cells per tick for ``kind`` ``"F"`` (forward) or ``"B"`` (backward)."""
        if kind not in KINDS:
            raise ScheduleError(f"kind must be one of {', '.join(KINDS)} (kind: {kind!r})")
        return (forward_ticks if kind == "F" else backward_ticks)(self.chunks, self.stages)

    def rows(self, kind: str = "F") -> List[List[str]]:
        """The tick x stage grid: ``rows[k][j]`` is ``"F<i>"`` / ``"B<i>"`` or ``"."`` when idle."""
        return grid_rows(self.ticks(kind), self.stages, kind)

    @property
    def bubble(self) -> float:
        """The theoretical idle fraction of the devices, (n - 1) / (m + n - 1)."""
        return (self.stages - 1) / (self.chunks + self.stages - 1)


@functools.lru_cache(maxsize=64)
def cached_ticks(chunks: int, stages: int, kind: str) -> Tuple[Tuple[Cell, ...], ...]:
    """``GPipeSchedule(chunks, stages).ticks(kind)`` made once per (chunks, stages, kind), immutable,
    so that a training loop does not rebuild its schedule every step."""
    return tuple(tuple(tick) for tick in GPipeSchedule(chunks, stages).ticks(kind))


def grid_rows(ticks: Sequence[Sequence[Cell]], stages: int, kind: str = "F") -> List[List[str]]:
    """Lay cells per tick out as a tick x stage grid of labels (``"F3"``, ``"."`` for idle)."""
    rows = []
    for k, tick in enumerate(ticks):
        row = ["."] * stages
        for i, j in tick:
            if not 0 <= j < stages:
                raise ScheduleError(f"cell (micro-batch {i}, stage {j}) at tick {k} is outside stages 0..{stages - 1}")
            if row[j] != ".":
                raise ScheduleError(f"stage {j} has two cells at tick {k} ({row[j]} and {kind}{i})")
            row[j] = f"{kind}{i}"
        rows.append(row)
    return rows


def format_grid(rows: Sequence[Sequence[str]], mark: Optional[Cell] = None) -> str:
    """Print a tick x stage grid as text; ``mark=(k, j)`` puts that cell in ``>...<`` brackets."""
    stages = max((len(row) for row in rows), default=0)
    width = max([len(label) + 2 for row in rows for label in row] + [len(f"stage {stages - 1}")])
    lines = ["tick | " + " | ".join(f"stage {j}".ljust(width) for j in range(stages))]
    for k, row in enumerate(rows):
        cells = []
        for j, label in enumerate(row):
            cells.append((f">{label}<" if mark == (k, j) else label).ljust(width))
        lines.append(f"{k:>4} | " + " | ".join(cells))
    return "\n".join(line.rstrip() for line in lines)


def check_rows(actual: Sequence[Sequence[str]], expected: Sequence[Sequence[str]]) -> None:
    """Compare a schedule's grid with an expected one; on the first difference raise ScheduleError
    printing both grids with the differing cell marked."""
    for k in range(max(len(actual), len(expected))):
        got = list(actual[k]) if k < len(actual) else []
        want = list(expected[k]) if k < len(expected) else []
        for j in range(max(len(got), len(want))):
            a = got[j] if j < len(got) else "<none>"
            e = want[j] if j < len(want) else "<none>"
            if a != e:
                raise ScheduleError(
                    f"schedule differs at tick {k}, stage {j} (got {a}, expected {e})\n"
                    f"got:\n{format_grid(actual, (k, j))}\nexpected:\n{format_grid(expected, (k, j))}"
                )


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

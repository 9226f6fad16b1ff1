"""A schedule on the clock: laying per-stage action lists on ticks, checking they finish, printing and cutting the grid.

``clock_table`` lays a schedule's lists on a clock (every action one tick, an action starting once
what it needs has finished on the neighbouring stage), idle slots ``None``, and refuses a schedule
that cannot finish by printing the step x rank grid with the blocked cell marked; ``table_bubble`` is
its idle share; ``pass_ticks`` cuts the table into the forward and backward ticks the one-process
executor (``dualframe.pipeline.executor``) runs; ``grid_rows``/``format_grid``/``check_rows`` print
and compare such ticks. Index names as in ``dualframe.pipeline.action``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from dualframe.errors import ScheduleError
from dualframe.pipeline.action import BACKWARD, FORWARD, KINDS, WEIGHT, Action, Cell, Table, Ticks


def peak_live_activations(actions: Sequence[Action], held_until: str = BACKWARD) -> int:
    """Most micro-batches whose forward ran and whose ``held_until`` pass has not, at any point of ``actions``.

    ``held_until="B"`` (default) counts the activations a backward frees; with a split backward
    (W actions) ``held_until="W"`` counts the micro-batches still holding anything (what the W pass
    reads: each layer's input and its output's gradient).

    Example:
        >>> from dualframe.pipeline.schedule import zb_h1
        >>> [peak_live_activations(a) for a in zb_h1(2, 4)], [peak_live_activations(a, "W") for a in zb_h1(2, 4)]
        ([2, 1], [2, 2])
    """
    if held_until not in (BACKWARD, WEIGHT):
        raise ScheduleError(f"held_until must be one of {BACKWARD}, {WEIGHT} (held_until: {held_until!r})")
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1 if action.kind == held_until else 0
        peak = max(peak, live)
    return peak


#: What has finished, and when: (stage, kind, micro-batch) -> tick.
Finished = Dict[Tuple[int, str, int], int]


def _ready(action: Action, j: int, n: int, finished: Finished, k: int) -> bool:
    """Whether the rank running ``action`` (on stage j of n) may start it at tick k: what it needs finished before k."""
    i = action.micro
    if action.kind == FORWARD:
        needed = (j - 1, FORWARD, i) if j > 0 else None
    elif action.kind == WEIGHT:
        # The weight gradient reads the output's gradient that this stage's own B i received.
        needed = (j, BACKWARD, i)
    else:
        # The last stage turns its own forward into the loss; the others wait for the gradient.
        needed = (j + 1, BACKWARD, i) if j < n - 1 else (j, FORWARD, i)
    return needed is None or finished.get(needed, k) < k


def _stage_actions(lists: Sequence[Sequence[Action]]) -> Dict[int, List[Action]]:
    """Each stage's actions in order, the stage plain (``Action.on``), refusing a stage run on two ranks."""
    by_stage: Dict[int, List[Action]] = {}
    rank_of: Dict[int, int] = {}
    for rank, actions in enumerate(lists):
        for action in actions:
            j = action.on(rank)
            if rank_of.setdefault(j, rank) != rank:
                raise ScheduleError(f"stage {j} runs on rank {rank_of[j]} and on rank {rank}; a stage lives on one "
                                    f"rank (rank {rank}: {' '.join(map(str, actions))})")
            by_stage.setdefault(j, []).append(Action(action.kind, action.micro))
    missing = sorted(set(range(max(by_stage, default=-1) + 1)) - set(by_stage))
    if missing or any(j < 0 for j in by_stage):
        raise ScheduleError(f"the stages must be 0..n-1, each on some rank (stages: {sorted(by_stage)})")
    return by_stage


def _validate_lists(lists: Sequence[Sequence[Action]]) -> int:
    """Check each stage runs F i and B i (and W i on every stage or on none) once each; return m."""
    if not lists:
        raise ScheduleError("a schedule needs at least one stage (action lists: [])")
    by_stage = _stage_actions(lists)
    first = by_stage.get(0, [])
    m = sum(action.kind == FORWARD for action in first)
    kinds = KINDS if any(action.kind == WEIGHT for actions in lists for action in actions) else KINDS[:2]
    expected = sorted(Action(kind, i) for kind in kinds for i in range(m))
    for j, actions in sorted(by_stage.items()):
        if sorted(actions) != expected:
            names = [f"{kind}0..{kind}{m - 1}" for kind in kinds]
            raise ScheduleError(
                f"stage {j} must run {', '.join(names[:-1])} and {names[-1]} once each "
                f"(stage {j}: {' '.join(map(str, actions))})"
            )
        for position, action in enumerate(actions):
            before = {FORWARD: None, BACKWARD: FORWARD, WEIGHT: BACKWARD}[action.kind]
            if before is not None and Action(before, action.micro) not in actions[:position]:
                raise ScheduleError(f"stage {j} runs {action} before {before}{action.micro} (position {position})")
    return m


def clock_table(lists: Sequence[Sequence[Action]]) -> Table:
    """Lay per-rank action lists on a clock: ``table[k][r]`` is rank r's action at tick k, or None.

    Every action takes one tick and starts as soon as its input is ready (the previous stage's
    forward, the next stage's backward; a weight gradient W i, this stage's own B i), whichever rank
    holds that stage: list r runs stage r unless its actions name theirs (virtual stages). Raises
    ScheduleError with the grid when no rank can move (stuck cells marked).

    Example:
        >>> from dualframe.pipeline.schedule import gpipe
        >>> [" ".join(str(cell or ".") for cell in row) for row in clock_table(gpipe(2, 2))]
        ['F0 .', 'F1 F0', '. F1', '. B1', 'B1 B0', 'B0 .']
    """
    ranks, _ = len(lists), _validate_lists(lists)
    n = len(_stage_actions(lists))
    position = [0] * ranks
    finished: Finished = {}
    table: Table = []
    k = 0
    while any(position[r] < len(lists[r]) for r in range(ranks)):
        row: List[Optional[Action]] = [None] * ranks
        for r in range(ranks):
            if position[r] < len(lists[r]):
                action = lists[r][position[r]]
                if _ready(action, action.on(r), n, finished, k):
                    row[r] = action
        if all(cell is None for cell in row):
            pending = [r for r in range(ranks) if position[r] < len(lists[r])]
            table.append([lists[r][position[r]] if r in pending else None for r in range(ranks)])
            what = "stage" if n == ranks and all(a.stage is None for a in lists[0]) else "rank"
            waits = ", ".join(f"{what} {r} for {lists[r][position[r]]}" for r in pending)
            raise ScheduleError(
                f"the schedule cannot finish: at tick {k} no {what} can move ({waits}; marked *):\n"
                + format_table(table, marks=[(k, r) for r in pending])
            )
        for r, cell in enumerate(row):
            if cell is not None:
                finished[(cell.on(r), cell.kind, cell.micro)] = k
                position[r] += 1
        table.append(row)
        k += 1
    return table


def format_table(table: Table, marks: Sequence[Tuple[int, int]] = ()) -> str:
    """The step x rank grid as text, one line per tick, ``.`` for idle, ``*`` after marked (k, j) cells."""
    n = len(table[0]) if table else 0
    width = max([4] + [len(str(cell)) + 1 for row in table for cell in row if cell is not None])
    lines = ["k\\j" + "".join(f"{j:>{width}}" for j in range(n))]
    for k, row in enumerate(table):
        cells = []
        for j, cell in enumerate(row):
            text = "." if cell is None else str(cell)
            cells.append(f"{text + ('*' if (k, j) in marks else ''):>{width}}")
        lines.append(f"{k:>3}" + "".join(cells))
    return "\n".join(lines)


def table_bubble(table: Table) -> float:
    """Share of a clock table's stage-ticks left idle (``gpipe_bubble`` for GPipe and 1F1B).

    Example:
        >>> from dualframe.pipeline.schedule import gpipe
        >>> table_bubble(clock_table(gpipe(2, 2)))
        0.3333333333333333
    """
    cells = [cell for row in table for cell in row]
    return sum(cell is None for cell in cells) / len(cells) if cells else 0.0


def gpipe_bubble(stages: int, chunks: int) -> float:
    """GPipe's idle share of a step with equal cells, ``(n - 1) / (m + n - 1)``: the one formula.

    Example:
        >>> round(gpipe_bubble(stages=4, chunks=16), 4)
        0.1579
    """
    return (stages - 1) / (chunks + stages - 1)


def zb_h1_bubble(stages: int, chunks: int) -> float:
    """ZB-H1's idle share with equal F, B and W cells and ``chunks >= stages``: ``(n - 1) / (3m + n - 1)``.

    A stage's n - 1 idle ticks now sit in a step of 3m busy ones (F, B, W per micro-batch), against
    1F1B's n - 1 idle backward-and-weight ticks of double length: about a third of 1F1B's bubble.

    Example:
        >>> round(zb_h1_bubble(stages=4, chunks=8), 4), round(gpipe_bubble(stages=4, chunks=8), 4)
        (0.1111, 0.2727)
    """
    return (stages - 1) / (3 * chunks + stages - 1)


def pass_ticks(table: Table, kind: str) -> Ticks:
    """The cells of one pass (``"F"`` or ``"B"``) per tick, from a table whose forwards all come first.

    Within a tick, the cell furthest along its pass comes first (forward: the highest stage;
    backward: the lowest), the order the executor hands cells to its lanes.

    Example:
        >>> from dualframe.pipeline.schedule import gpipe
        >>> pass_ticks(clock_table(gpipe(2, 2)), "B")
        (((1, 1),), ((1, 0), (0, 1)), ((0, 0),))
    """
    if kind not in (FORWARD, BACKWARD):
        raise ScheduleError(f"kind must be one of {FORWARD}, {BACKWARD} (kind: {kind!r})")
    kinds = [{cell.kind for cell in row if cell is not None} for row in table]
    first_backward = next((k for k, row in enumerate(kinds) if BACKWARD in row), len(table))
    late = [k for k, row in enumerate(kinds) if FORWARD in row and k >= first_backward]
    if late:
        raise ScheduleError(
            f"a forward runs at tick {late[0]}, after the first backward (tick {first_backward}), so the "
            f"table has no separate forward and backward pass (marked *):\n"
            + format_table(table, marks=[(late[0], j) for j, c in enumerate(table[late[0]]) if c and c.kind == FORWARD])
        )
    rows = table[:first_backward] if kind == FORWARD else table[first_backward:]
    order = range(len(table[0]) - 1, -1, -1) if kind == FORWARD else range(len(table[0]))
    return tuple(tuple((row[j].micro, j) for j in order if row[j] is not None) for row in rows)  # type: ignore[union-attr]


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
        cells = [(f">{label}<" if mark == (k, j) else label).ljust(width) for j, label in enumerate(row)]
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

"""Per-rank pipeline schedules as data: each stage's ordered forward/backward actions (GPipe, 1F1B).

Index names, fixed here once: ``i`` micro-batch, ``j`` stage, ``k`` clock tick, ``m`` micro-batches
(``chunks``), ``n`` stages. A schedule is a list with one entry per stage j: the ordered actions that
stage runs in one training step, ``F i`` (forward of micro-batch i) and ``B i`` (its backward).

``clock_table`` lays those lists on a clock (every action one tick, an action starting once what it
needs has finished on the neighbouring stage), with idle slots as ``None``; a schedule that cannot
finish is refused with the step x rank grid printed and the blocked cell marked. ``link_messages``
derives, from the same data, the order in which two neighbouring stages exchange activations and
gradients, so both sides post the same transfers in the same order and cannot deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from dualframe.errors import ScheduleError
from dualframe.pipeline.microbatch import validate_chunks
from dualframe.strategy import SCHEDULES, RankGrid

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage: ``Action("F", 3)`` is the forward of micro-batch 3, shown ``F3``.

    Example:
        >>> Action.parse("B2")
        Action(kind='B', micro=2)
        >>> str(Action("F", 0))
        'F0'
    """

    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``"F3"`` -> ``Action("F", 3)``."""
        if len(text) < 2 or text[0] not in (FORWARD, BACKWARD) or not text[1:].isdigit():
            raise ScheduleError(f"an action is F<micro-batch> or B<micro-batch> (action: {text!r})")
        return cls(text[0], int(text[1:]))


Table = List[List[Optional[Action]]]


def _check(stages: int, chunks: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ScheduleError(f"stages must be an int >= 1 (stages: {stages!r})")
    validate_chunks(chunks)


def gpipe(stages: int, chunks: int) -> List[List[Action]]:
    """GPipe: every stage runs all forwards, then all backwards in reverse (``F0 F1 B1 B0``).

    Example:
        >>> [" ".join(map(str, actions)) for actions in gpipe(2, 2)]
        ['F0 F1 B1 B0', 'F0 F1 B1 B0']
    """
    _check(stages, chunks)
    m = chunks
    actions = [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in reversed(range(m))]
    return [list(actions) for _ in range(stages)]


def one_f_one_b(stages: int, chunks: int) -> List[List[Action]]:
    """1F1B (PipeDream-flush): stage j warms up with ``min(n - j - 1, m)`` forwards, then alternates.

    Stage j keeps at most ``n - j`` micro-batches' activations alive, against ``m`` with GPipe.

    Example:
        >>> [" ".join(map(str, actions)) for actions in one_f_one_b(2, 3)]
        ['F0 F1 B0 F2 B1 B2', 'F0 B0 F1 B1 F2 B2']
    """
    _check(stages, chunks)
    n, m = stages, chunks
    plans = []
    for j in range(n):
        warmup = min(n - j - 1, m)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
        actions += [Action(BACKWARD, i) for i in range(m - warmup, m)]
        plans.append(actions)
    return plans


def rank_schedule(schedule: str, stages: int, chunks: int) -> List[List[Action]]:
    """The per-stage action lists of the schedule named ``"gpipe"`` or ``"1f1b"``.

    Raises:
        ScheduleError: an unknown name, or ``stages``/``chunks`` below one.
    """
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    builder = gpipe if schedule.lower() == "gpipe" else one_f_one_b
    plans = builder(stages, chunks)
    clock_table(plans)  # proves the plan finishes; cheap next to a training step
    return plans


def peak_live_activations(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not, at any point of ``actions``."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def _ready(action: Action, j: int, n: int, finished: Dict[Tuple[int, Action], int], k: int) -> bool:
    """Whether stage j may start ``action`` at tick k: what it needs finished before tick k."""
    if action.kind == FORWARD:
        needed = (j - 1, action) if j > 0 else None
    else:
        # The last stage turns its own forward into the loss; the others wait for the gradient.
        needed = (j + 1, action) if j < n - 1 else (j, Action(FORWARD, action.micro))
    return needed is None or finished.get(needed, k) < k


def _validate_lists(plans: Sequence[Sequence[Action]]) -> int:
    """Check each stage runs F i and B i once each for the same micro-batches; return m."""
    if not plans:
        raise ScheduleError("a schedule needs at least one stage (plans: [])")
    m = len(plans[0]) // 2
    expected = sorted([Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)])
    for j, actions in enumerate(plans):
        if sorted(actions) != expected:
            raise ScheduleError(
                f"stage {j} must run F0..F{m - 1} and B0..B{m - 1} once each "
                f"(stage {j}: {' '.join(map(str, actions))})"
            )
        for position, action in enumerate(actions):
            if action.kind == BACKWARD and Action(FORWARD, action.micro) not in actions[:position]:
                raise ScheduleError(f"stage {j} runs {action} before F{action.micro} (position {position})")
    return m


def clock_table(plans: Sequence[Sequence[Action]]) -> Table:
    """Lay per-stage action lists on a clock: ``table[k][j]`` is stage j's action at tick k, or None.

    Every action takes one tick and starts as soon as its input is ready (the previous stage's
    forward, the next stage's backward). Raises ScheduleError with the grid, blocked cell marked,
    when no stage can move (stuck cells marked).

    Example:
        >>> [" ".join(str(cell or ".") for cell in row) for row in clock_table(gpipe(2, 2))]
        ['F0 .', 'F1 F0', '. F1', '. B1', 'B1 B0', 'B0 .']
    """
    n, _ = len(plans), _validate_lists(plans)
    position = [0] * n
    finished: Dict[Tuple[int, Action], int] = {}
    table: Table = []
    k = 0
    while any(position[j] < len(plans[j]) for j in range(n)):
        row: List[Optional[Action]] = [None] * n
        for j in range(n):
            if position[j] < len(plans[j]) and _ready(plans[j][position[j]], j, n, finished, k):
                row[j] = plans[j][position[j]]
        if all(cell is None for cell in row):
            pending = [j for j in range(n) if position[j] < len(plans[j])]
            table.append([plans[j][position[j]] if j in pending else None for j in range(n)])
            waits = ", ".join(f"stage {j} for {plans[j][position[j]]}" for j in pending)
            raise ScheduleError(
                f"the schedule cannot finish: at tick {k} no stage can move ({waits}; marked *):\n"
                + format_table(table, marks=[(k, j) for j in pending])
            )
        for j, cell in enumerate(row):
            if cell is not None:
                finished[(j, cell)] = k
                position[j] += 1
        table.append(row)
        k += 1
    return table


def format_table(table: Table, marks: Sequence[Tuple[int, int]] = ()) -> str:
    """The step x rank grid as text, one line per tick, ``.`` for idle, ``*`` after marked (k, j) cells."""
    n = len(table[0]) if table else 0
    lines = ["k\\j" + "".join(f"{j:>4}" for j in range(n))]
    for k, row in enumerate(table):
        cells = []
        for j, cell in enumerate(row):
            text = "." if cell is None else str(cell)
            cells.append(f"{text + ('*' if (k, j) in marks else ''):>4}")
        lines.append(f"{k:>3}" + "".join(cells))
    return "\n".join(lines)


def bubble_fraction(table: Table) -> float:
    """Share of stage-ticks left idle: ``(n - 1) / (m + n - 1)`` for GPipe with equal costs."""
    cells = [cell for row in table for cell in row]
    return sum(cell is None for cell in cells) / len(cells) if cells else 0.0


@dataclass(frozen=True)
class Message:
    """One transfer over the link between stage j and j + 1: an activation forward or a gradient back.

    ``tag`` is ``"F3"`` for micro-batch 3's activation (j -> j + 1) and ``"B3"`` for its gradient
    (j + 1 -> j); ``sender`` and ``receiver`` are stage indices.
    """

    tag: str
    sender: int
    receiver: int


def link_messages(plans: Sequence[Sequence[Action]], j: int) -> List[Message]:
    """Messages stage j takes part in, in the order stage j posts them (sends and receives).

    Stage j receives ``F i`` from j - 1 before running F i and sends its output to j + 1 after;
    it receives ``B i`` from j + 1 before running B i and sends its input's gradient to j - 1 after.
    """
    n = len(plans)
    messages = []
    for action in plans[j]:
        upstream, downstream = (j - 1, j + 1) if action.kind == FORWARD else (j + 1, j - 1)
        if 0 <= upstream < n:
            messages.append(Message(str(action), upstream, j))
        if 0 <= downstream < n:
            messages.append(Message(str(action), j, downstream))
    return messages


def check_link_order(plans: Sequence[Sequence[Action]]) -> None:
    """Raise ScheduleError unless both ends of every link see its messages in the same order."""
    n = len(plans)
    for j in range(n - 1):
        left = [msg for msg in link_messages(plans, j) if j + 1 in (msg.sender, msg.receiver)]
        right = [msg for msg in link_messages(plans, j + 1) if j in (msg.sender, msg.receiver)]
        for direction in (FORWARD, BACKWARD):
            a = [msg.tag for msg in left if msg.tag[0] == direction]
            b = [msg.tag for msg in right if msg.tag[0] == direction]
            if a != b:
                raise ScheduleError(
                    f"stages {j} and {j + 1} would exchange {direction} messages in different orders "
                    f"(stage {j}: {' '.join(a)}; stage {j + 1}: {' '.join(b)})"
                )


def pipeline_process_sets(world_size: int, stages: int) -> List[List[int]]:
    """The groups of ranks a pipeline of ``stages`` over ``world_size`` ranks communicates in.

    Neighbouring pairs of each pipeline (activations, gradients), each whole pipeline (the step's
    agreement, the loss) and each stage's replicas (gradient averaging). Groups of one rank and the
    whole world (Horovod's global set) are left out, as are repeats. Declare them at start-up:
    ``hvd.init(process_sets=pipeline_process_sets(hvd_size, 2))``.

    Example:
        >>> pipeline_process_sets(4, 2)
        [[0, 1], [2, 3], [0, 2], [1, 3]]
    """
    grid = RankGrid.build(world_size, stages)
    candidates: List[List[int]] = []
    for group in grid.pipeline_groups:
        candidates += [[a, b] for a, b in zip(group, group[1:])]
    candidates += grid.pipeline_groups + grid.stage_groups
    chosen: List[List[int]] = []
    for ranks in candidates:
        if 1 < len(ranks) < world_size and ranks not in chosen:
            chosen.append(ranks)
    return chosen

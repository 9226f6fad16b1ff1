"""Pipeline schedules as data: per-stage action lists (GPipe, 1F1B), the registry that names them, their clock.

Index names, fixed here once: ``i`` micro-batch, ``j`` stage, ``k`` clock tick, ``m`` micro-batches
(``chunks``), ``n`` stages. A schedule is a list with one entry per stage j: the ordered actions that
stage runs in one training step, ``F i`` (forward of micro-batch i) and ``B i`` (its backward).

A schedule joins the house in one place, ``register``: its builder, and whether the one-process
``Pipeline`` (whose caller computes the loss after forward returns) can run it. Everything else
derives from the lists: ``clock_table`` lays them on a clock (every action one tick, an action starting
once what it needs has finished on the neighbouring stage), idle slots ``None``, and refuses a schedule
that cannot finish by printing the step x rank grid with the blocked cell marked; ``pass_ticks`` cuts
that table into the forward and backward ticks the one-process executor (``pipeline.executor``) runs;
``link_messages`` gives the order in which two neighbouring stages exchange activations and gradients.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dualframe.errors import ScheduleError
from dualframe.pipeline.microbatch import validate_chunks

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


#: One ordered action list per stage: ``lists[j]`` is what stage j runs in one step.
ActionLists = List[List[Action]]
#: ``table[k][j]``: stage j's action at clock tick k, None when idle.
Table = List[List[Optional[Action]]]
#: ``(i, j)``: micro-batch i on stage j; ticks list the cells of one pass per clock tick.
Cell = Tuple[int, int]
Ticks = Tuple[Tuple[Cell, ...], ...]


def _stages(stages: int) -> int:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ScheduleError(f"stages must be an int >= 1 (stages: {stages!r})")
    return stages


def gpipe(stages: int, chunks: int) -> ActionLists:
    """GPipe: every stage runs all forwards, then all backwards in reverse (``F0 F1 B1 B0``).

    Example:
        >>> [" ".join(map(str, actions)) for actions in gpipe(2, 2)]
        ['F0 F1 B1 B0', 'F0 F1 B1 B0']
    """
    n, m = _stages(stages), validate_chunks(chunks)
    actions = [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in reversed(range(m))]
    return [list(actions) for _ in range(n)]


def one_f_one_b(stages: int, chunks: int) -> ActionLists:
    """1F1B (PipeDream-flush): stage j warms up with ``min(n - j - 1, m)`` forwards, then alternates.

    Stage j keeps at most ``n - j`` micro-batches' activations alive, against ``m`` with GPipe.

    Example:
        >>> [" ".join(map(str, actions)) for actions in one_f_one_b(2, 3)]
        ['F0 F1 B0 F2 B1 B2', 'F0 B0 F1 B1 F2 B2']
    """
    n, m = _stages(stages), validate_chunks(chunks)
    lists = []
    for j in range(n):
        warmup = min(n - j - 1, m)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
        actions += [Action(BACKWARD, i) for i in range(m - warmup, m)]
        lists.append(actions)
    return lists


#: A schedule's builder: ``build(stages, chunks)`` -> one action list per stage.
Builder = Callable[[int, int], ActionLists]


@dataclass(frozen=True)
class ScheduleEntry:
    """A schedule in the registry: its name, its builder, and whether one process can run it.

    ``one_process``: the schedule finishes every forward before any backward, so the one-process
    ``Pipeline`` can run it although its caller computes the loss after forward returns (``pass_ticks``
    checks the claim on the clock table). When False, ``why_not`` says why, for the refusal.
    """

    name: str
    build: Builder
    one_process: bool
    why_not: str = ""


_REGISTRY: Dict[str, ScheduleEntry] = {}


def register(name: str, build: Builder, *, one_process: bool, why_not: str = "") -> Builder:
    """Add a schedule under ``name`` (lower case); every adapter and ``dualframe.Pipeline`` then accept it.

    Example:
        >>> def fifo_gpipe(stages, chunks):  # a toy: GPipe with the backwards in forward order
        ...     return [sorted(a, key=lambda x: (x.kind == "B", x.micro)) for a in gpipe(stages, chunks)]
        >>> _ = register("toy", fifo_gpipe, one_process=True)
        >>> "toy" in schedule_names(); unregister("toy")
        True

    Raises:
        ScheduleError: the name is taken or not lower case, or a schedule one process cannot run
            comes without ``why_not``.
    """
    if not isinstance(name, str) or not name or name != name.lower():
        raise ScheduleError(f"a schedule name is a non-empty lower-case string (name: {name!r})")
    if name in _REGISTRY:
        raise ScheduleError(f"schedule {name!r} is already registered; choose another name")
    if not one_process and not why_not:
        raise ScheduleError(f"schedule {name!r}: say in why_not why the one-process Pipeline cannot run it")
    _REGISTRY[name] = ScheduleEntry(name, build, bool(one_process), why_not)
    return build


def unregister(name: str) -> None:
    """Remove a schedule added by ``register`` (for tests and experiments)."""
    _REGISTRY.pop(name, None)
    _one_process_ticks.cache_clear()


def schedule_names(one_process: Optional[bool] = None) -> Tuple[str, ...]:
    """The registered names, in registration order; ``one_process=True``: those one process can run."""
    return tuple(s.name for s in _REGISTRY.values() if one_process is None or s.one_process == one_process)


def registered(schedule: str) -> ScheduleEntry:
    """The registry entry of ``schedule`` (any case); ScheduleError naming the choices otherwise.

    Example:
        >>> registered("GPipe").one_process
        True
    """
    if not isinstance(schedule, str) or schedule.lower() not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {schedule!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[schedule.lower()]


def one_process(schedule: str) -> ScheduleEntry:
    """The entry of ``schedule`` if the one-process ``Pipeline`` can run it; ScheduleError saying why not.

    Example:
        >>> one_process("1f1b")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        dualframe.errors.ScheduleError: the one-process Pipeline cannot run schedule '1f1b': ...
    """
    entry = registered(schedule)
    if not entry.one_process:
        raise ScheduleError(
            f"the one-process Pipeline cannot run schedule {entry.name!r}: {entry.why_not}; use "
            f"schedule={' or '.join(repr(s) for s in schedule_names(True))} here, or "
            f"DistributedPipeline(..., schedule={entry.name!r}, loss_fn=...), which holds the loss"
        )
    return entry


def rank_schedule(schedule: str, stages: int, chunks: int) -> ActionLists:
    """The per-stage action lists of the registered schedule ``schedule`` (``"gpipe"``, ``"1f1b"``).

    Raises:
        ScheduleError: an unknown name, or ``stages`` below one. ChunksError: ``chunks`` below one.
    """
    lists = registered(schedule).build(_stages(stages), validate_chunks(chunks))
    clock_table(lists)  # proves the lists finish; cheap next to a training step
    return lists


register("gpipe", gpipe, one_process=True)
register("1f1b", one_f_one_b, one_process=False,
         why_not="1f1b interleaves backward with forward (B0 runs before the last forward), which needs "
                 "the loss inside the pipeline, but this Pipeline returns the output and its caller "
                 "computes the loss after forward returns")


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


def _validate_lists(lists: Sequence[Sequence[Action]]) -> int:
    """Check each stage runs F i and B i once each for the same micro-batches; return m."""
    if not lists:
        raise ScheduleError("a schedule needs at least one stage (action lists: [])")
    m = len(lists[0]) // 2
    expected = sorted([Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)])
    for j, actions in enumerate(lists):
        if sorted(actions) != expected:
            raise ScheduleError(
                f"stage {j} must run F0..F{m - 1} and B0..B{m - 1} once each "
                f"(stage {j}: {' '.join(map(str, actions))})"
            )
        for position, action in enumerate(actions):
            if action.kind == BACKWARD and Action(FORWARD, action.micro) not in actions[:position]:
                raise ScheduleError(f"stage {j} runs {action} before F{action.micro} (position {position})")
    return m


def clock_table(lists: Sequence[Sequence[Action]]) -> Table:
    """Lay per-stage action lists on a clock: ``table[k][j]`` is stage j's action at tick k, or None.

    Every action takes one tick and starts as soon as its input is ready (the previous stage's
    forward, the next stage's backward). Raises ScheduleError with the grid, blocked cell marked,
    when no stage can move (stuck cells marked).

    Example:
        >>> [" ".join(str(cell or ".") for cell in row) for row in clock_table(gpipe(2, 2))]
        ['F0 .', 'F1 F0', '. F1', '. B1', 'B1 B0', 'B0 .']
    """
    n, _ = len(lists), _validate_lists(lists)
    position = [0] * n
    finished: Dict[Tuple[int, Action], int] = {}
    table: Table = []
    k = 0
    while any(position[j] < len(lists[j]) for j in range(n)):
        row: List[Optional[Action]] = [None] * n
        for j in range(n):
            if position[j] < len(lists[j]) and _ready(lists[j][position[j]], j, n, finished, k):
                row[j] = lists[j][position[j]]
        if all(cell is None for cell in row):
            pending = [j for j in range(n) if position[j] < len(lists[j])]
            table.append([lists[j][position[j]] if j in pending else None for j in range(n)])
            waits = ", ".join(f"stage {j} for {lists[j][position[j]]}" for j in pending)
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


def table_bubble(table: Table) -> float:
    """Share of a clock table's stage-ticks left idle (``gpipe_bubble`` for GPipe and 1F1B).

    Example:
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


def pass_ticks(table: Table, kind: str) -> Ticks:
    """The cells of one pass (``"F"`` or ``"B"``) per tick, from a table whose forwards all come first.

    Within a tick, the cell furthest along its pass comes first (forward: the highest stage;
    backward: the lowest), the order the executor hands cells to its lanes.

    Example:
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


def one_process_ticks(schedule: str, chunks: int, stages: int, kind: str) -> Ticks:
    """The ticks of one pass of ``schedule`` for the one-process executor, made once per arguments.

    Example:
        >>> one_process_ticks("gpipe", chunks=2, stages=2, kind="F")
        (((0, 0),), ((0, 1), (1, 0)), ((1, 1),))

    Raises:
        ScheduleError: an unknown schedule, one that one process cannot run, a bad ``stages`` or ``kind``.
        ChunksError: ``chunks`` below one.
    """
    name = one_process(schedule).name
    if kind not in (FORWARD, BACKWARD):
        raise ScheduleError(f"kind must be one of {FORWARD}, {BACKWARD} (kind: {kind!r})")
    return _one_process_ticks(name, validate_chunks(chunks), _stages(stages), kind)


@functools.lru_cache(maxsize=64)
def _one_process_ticks(name: str, chunks: int, stages: int, kind: str) -> Ticks:
    # Cached so that a training loop does not lay its schedule on the clock every step.
    return pass_ticks(clock_table(rank_schedule(name, stages, chunks)), kind)


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


@dataclass(frozen=True)
class Message:
    """One transfer over the link between stage j and j + 1: an activation forward or a gradient back.

    ``tag`` is ``"F3"`` for micro-batch 3's activation (j -> j + 1) and ``"B3"`` for its gradient
    (j + 1 -> j); ``sender`` and ``receiver`` are stage indices.
    """

    tag: str
    sender: int
    receiver: int


def link_messages(lists: Sequence[Sequence[Action]], j: int) -> List[Message]:
    """Messages stage j takes part in, in the order stage j posts them (sends and receives).

    Stage j receives ``F i`` from j - 1 before running F i and sends its output to j + 1 after;
    it receives ``B i`` from j + 1 before running B i and sends its input's gradient to j - 1 after.
    """
    n = len(lists)
    messages = []
    for action in lists[j]:
        upstream, downstream = (j - 1, j + 1) if action.kind == FORWARD else (j + 1, j - 1)
        if 0 <= upstream < n:
            messages.append(Message(str(action), upstream, j))
        if 0 <= downstream < n:
            messages.append(Message(str(action), j, downstream))
    return messages


def check_link_order(lists: Sequence[Sequence[Action]]) -> None:
    """Raise ScheduleError unless both ends of every link see its messages in the same order."""
    for j in range(len(lists) - 1):
        left = [msg for msg in link_messages(lists, j) if j + 1 in (msg.sender, msg.receiver)]
        right = [msg for msg in link_messages(lists, j + 1) if j in (msg.sender, msg.receiver)]
        for direction in (FORWARD, BACKWARD):
            a = [msg.tag for msg in left if msg.tag[0] == direction]
            b = [msg.tag for msg in right if msg.tag[0] == direction]
            if a != b:
                raise ScheduleError(
                    f"stages {j} and {j + 1} would exchange {direction} messages in different orders "
                    f"(stage {j}: {' '.join(a)}; stage {j + 1}: {' '.join(b)})"
                )


def pipeline_process_sets(world_size: int, stages: int, graph: bool = False) -> List[List[int]]:
    """The groups of ranks a pipeline of ``stages`` over ``world_size`` ranks communicates in.

    Neighbouring pairs of each pipeline (activations, gradients), each whole pipeline (the step's
    agreement, the loss) and each stage's replicas (gradient averaging). With ``graph``, every pair
    of stages of a pipeline too: a graph split sends a value skipping stages straight to its reader
    (``dualframe.pipeline.graph_walk``), whichever pairs the cut makes. Groups of one rank and the
    whole world (Horovod's global set) are left out, as are repeats. Declare them at start-up:
    ``hvd.init(process_sets=pipeline_process_sets(hvd_size, 2))``.

    Example:
        >>> pipeline_process_sets(4, 2)
        [[0, 1], [2, 3], [0, 2], [1, 3]]
        >>> pipeline_process_sets(3, 3, graph=True)
        [[0, 1], [1, 2], [0, 2]]
    """
    # Imported here: dualframe.strategy validates schedule names against this module's registry.
    from dualframe.strategy import RankGrid

    grid = RankGrid.build(world_size, stages)
    candidates: List[List[int]] = []
    for group in grid.pipeline_groups:
        candidates += [[a, b] for a, b in zip(group, group[1:])]
        if graph:
            candidates += [[group[p], group[c]] for c in range(len(group)) for p in range(c - 1)]
    candidates += grid.pipeline_groups + grid.stage_groups
    chosen: List[List[int]] = []
    for ranks in candidates:
        if 1 < len(ranks) < world_size and ranks not in chosen:
            chosen.append(ranks)
    return chosen

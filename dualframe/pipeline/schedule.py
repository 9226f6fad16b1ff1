"""Pipeline schedules as data: the per-stage action lists (GPipe, 1F1B, ZB-H1) and the registry that names them.

Index names as in ``dualframe.pipeline.action``: ``i`` micro-batch, ``j`` stage, ``k`` clock tick, ``m``
micro-batches (``chunks``), ``n`` stages. A schedule is a list with one entry per stage j: the ordered
actions that stage runs in one training step, ``F i`` (forward of micro-batch i) and ``B i`` (its backward),
or, for a zero-bubble schedule, ``B i`` (its input gradient) and ``W i`` (its weight gradient).

A schedule joins the house in one place, ``register``: its builder, and whether the one-process
``Pipeline`` (whose caller computes the loss after forward returns) can run it; a schedule of virtual
stages (several stages per rank, ``dualframe.pipeline.virtual``) registers with its ``VirtualRule``
(placement of stages on ranks, the chunks it needs). Everything else
derives from the lists: ``dualframe.pipeline.clock`` lays them on a clock and proves they finish;
``one_process_ticks`` cuts that table into the ticks the one-process executor runs;
``dualframe.pipeline.link_order.link_messages`` gives the order in which neighbouring stages exchange
activations and gradients.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dualframe.errors import ScheduleError
from dualframe.pipeline.action import BACKWARD, FORWARD, WEIGHT, Action, ActionLists, Ticks
from dualframe.pipeline.clock import clock_table, pass_ticks
from dualframe.pipeline.microbatch import validate_chunks
from dualframe.pipeline.virtual import (interleaved_1f1b, interleaved_check, interleaved_place, zb_v, zb_v_check,
                                        zb_v_place)


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


def zb_h1(stages: int, chunks: int) -> ActionLists:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split in two.

    ``B i`` computes only the input's gradient, which is all the previous stage waits for, so the
    backwards run down the pipeline a pass sooner; ``W i`` computes the weights' gradient later, in
    the ticks 1F1B leaves idle. Stage j keeps 1F1B's order of F and B and runs ``W(i - j)`` right
    after ``B i``, the last j weight passes at the end: every stage then holds at most n micro-batches
    (forward run, weight pass not yet), as 1F1B's first stage does, and the activations a B frees
    peak exactly as 1F1B's. With equal F, B and W the idle share is ``(n - 1) / (3m + n - 1)`` for
    ``m >= n`` (``clock.zb_h1_bubble``), about a third of 1F1B's.

    Example:
        >>> [" ".join(map(str, actions)) for actions in zb_h1(2, 3)]
        ['F0 F1 B0 W0 F2 B1 W1 B2 W2', 'F0 B0 F1 B1 W0 F2 B2 W1 W2']
    """
    lists = []
    for j, actions in enumerate(one_f_one_b(stages, chunks)):
        m = len(actions) // 2
        split: List[Action] = []
        for action in actions:
            split.append(action)
            if action.kind == BACKWARD and action.micro >= j:
                split.append(Action(WEIGHT, action.micro - j))
        split += [Action(WEIGHT, i) for i in range(max(m - j, 0), m)]
        lists.append(split)
    return lists


#: A schedule's builder: ``build(stages, chunks)`` -> one action list per stage.
Builder = Callable[[int, int], ActionLists]


@dataclass(frozen=True)
class VirtualRule:
    """How a schedule of virtual stages is built and placed: ranks x ``virtual_stages`` stages, several per rank.

    ``build(ranks, chunks, virtual_stages)`` -> one action list per rank, each action naming its stage;
    ``place(stage, ranks)`` -> the rank holding that stage; ``check(ranks, chunks, virtual_stages)``
    raises ScheduleError or ChunksError, naming the rule, for a combination the schedule cannot run.
    """

    build: Callable[[int, int, int], ActionLists]
    place: Callable[[int, int], int]
    check: Callable[[int, int, int], None]


@dataclass(frozen=True)
class ScheduleEntry:
    """A schedule in the registry: its name, its builder, and whether one process can run it.

    ``one_process``: the schedule finishes every forward before any backward, so the one-process
    ``Pipeline`` can run it although its caller computes the loss after forward returns (``pass_ticks``
    checks the claim on the clock table). When False, ``why_not`` says why, for the refusal.
    ``virtual``: a schedule of virtual stages (its builder then is ``virtual.build``).
    """

    name: str
    build: Builder
    one_process: bool
    why_not: str = ""
    virtual: Optional[VirtualRule] = None


_REGISTRY: Dict[str, ScheduleEntry] = {}


def register(name: str, build: Builder, *, one_process: bool, why_not: str = "",
             virtual: Optional[VirtualRule] = None) -> Builder:
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
    _REGISTRY[name] = ScheduleEntry(name, build, bool(one_process), why_not, virtual)
    return build


def unregister(name: str) -> None:
    """Remove a schedule added by ``register`` (for tests and experiments)."""
    _REGISTRY.pop(name, None)
    _one_process_ticks.cache_clear()


def schedule_names(one_process: Optional[bool] = None, virtual: Optional[bool] = None) -> Tuple[str, ...]:
    """The registered names, in registration order; ``one_process=True``: those one process can run;
    ``virtual=True``: those running several stages per rank."""
    return tuple(s.name for s in _REGISTRY.values() if (one_process is None or s.one_process == one_process)
                 and (virtual is None or (s.virtual is not None) == virtual))


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


def rank_schedule(schedule: str, stages: int, chunks: int, virtual_stages: int = 1) -> ActionLists:
    """The per-rank action lists of the registered schedule ``schedule`` (``"gpipe"``, ``"1f1b"``, ``"zb-v"``).

    ``stages``: ranks of the pipeline; with ``virtual_stages`` v > 1 each rank holds v stages
    (``stages * v`` in all) and every action names its stage.

    Example:
        >>> [" ".join(map(str, a)) for a in rank_schedule("interleaved-1f1b", 2, 2, virtual_stages=2)]
        ['0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1', '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1']

    Raises:
        ScheduleError: an unknown name, ``stages`` below one, or ``virtual_stages`` the schedule cannot run.
        ChunksError: ``chunks`` below one or not fitting the schedule's rule.
    """
    entry, n, m, v = registered(schedule), _stages(stages), validate_chunks(chunks), virtual_count(virtual_stages)
    if entry.virtual is not None:
        entry.virtual.check(n, m, v)
        lists = entry.virtual.build(n, m, v)
    elif v != 1:
        raise ScheduleError(
            f"schedule {entry.name!r} runs one stage per rank, so it cannot run virtual_stages={v}; use "
            f"schedule={' or '.join(repr(s) for s in schedule_names(virtual=True))}, or virtual_stages=1")
    else:
        lists = entry.build(n, m)
    clock_table(lists)  # proves the lists finish; cheap next to a training step
    return lists


def virtual_count(virtual_stages: int) -> int:
    """``virtual_stages`` if it is an int >= 1, else ScheduleError."""
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ScheduleError(f"virtual_stages must be an int >= 1, the stages each rank holds "
                            f"(virtual_stages: {virtual_stages!r})")
    return virtual_stages


def stage_placement(schedule: str, stages: int, virtual_stages: int = 1) -> List[int]:
    """The rank (position in its pipeline) holding each of the ``stages * virtual_stages`` stages.

    Example:
        >>> stage_placement("interleaved-1f1b", 2, 2), stage_placement("zb-v", 2, 2), stage_placement("1f1b", 3)
        ([0, 1, 0, 1], [0, 1, 1, 0], [0, 1, 2])
    """
    entry, n, v = registered(schedule), _stages(stages), virtual_count(virtual_stages)
    if entry.virtual is None:
        return list(range(n))
    return [entry.virtual.place(j, n) for j in range(n * v)]


def deferred_weights(plan: Sequence[Action]) -> List[Action]:
    """One rank's ``plan`` (a schedule without W actions) with a ``W i`` per ``B i`` at its end, in the B's order.

    A transform, not a schedule of its own: an adapter whose stage can batch its weight gradients runs
    it on GPipe's lists, so the B passes compute only what the previous stage waits for and the W
    actions, all after the last B, run as one pass over the step's rows (``batched_weights`` proves
    the transformed lists finish). W actions send nothing, so each rank may take it or not alone.

    Example:
        >>> [str(a) for a in deferred_weights([Action.parse(t) for t in "F0 F1 B1 B0".split()])]
        ['F0', 'F1', 'B1', 'B0', 'W1', 'W0']

    Raises:
        ScheduleError: ``plan`` already has W actions.
    """
    if any(action.kind == WEIGHT for action in plan):
        raise ScheduleError(f"deferred_weights adds W actions to a schedule without them "
                            f"(plan: {' '.join(map(str, plan))})")
    return list(plan) + [Action(WEIGHT, action.micro) for action in plan if action.kind == BACKWARD]


def forwards_first(lists: Sequence[Sequence[Action]]) -> bool:
    """Whether every rank runs all its forwards before any backward (GPipe): its tapes all live at once anyway.

    Where they do, ``batched_weights`` costs no memory a step does not already hold; elsewhere (1F1B)
    it would keep every micro-batch's layer inputs until the end.

    Example:
        >>> forwards_first(gpipe(2, 3)), forwards_first(one_f_one_b(2, 3))
        (True, False)
    """
    return all(not any(a.kind == FORWARD for a in actions[k + 1:])
               for actions in lists for k, a in enumerate(actions) if a.kind != FORWARD)


def batched_weights(lists: ActionLists) -> ActionLists:
    """Every rank's ``deferred_weights`` (GPipe with batched weight gradients), laid on ``clock_table`` first.

    Example:
        >>> [" ".join(map(str, a)) for a in batched_weights(gpipe(2, 2))]
        ['F0 F1 B1 B0 W1 W0', 'F0 F1 B1 B0 W1 W0']

    Raises:
        ScheduleError: lists with W actions already, or lists that cannot finish (the grid printed).
    """
    transformed = [deferred_weights(actions) for actions in lists]
    clock_table(transformed)
    return transformed


def fused_last_stage(lists: ActionLists) -> ActionLists:
    """GPipe's lists (W actions too) with the last stage's ``B i`` right after its ``F i``, the others' B's ascending.

    A last stage that runs a micro-batch's forward, loss and backward in one call (``fusable``) has
    every gradient for the stage before it once its forward ran; GPipe's order (``B7`` first) made that
    stage wait for the last forward before any backward. Here the backwards flow down the pipeline in
    the order they are made, W actions stay where they were (after the last B). Laid on ``clock_table``.

    Example:
        >>> [" ".join(map(str, a)) for a in fused_last_stage(gpipe(2, 2))]
        ['F0 F1 B0 B1', 'F0 B0 F1 B1']

    Raises:
        ScheduleError: lists that do not run every forward first (``forwards_first``).
    """
    if not forwards_first(lists):
        raise ScheduleError("fused_last_stage reorders lists that run every forward first (GPipe's) "
                            f"(lists: {[' '.join(map(str, actions)) for actions in lists]})")
    transformed = []
    for j, actions in enumerate(lists):
        forwards = [a for a in actions if a.kind == FORWARD]
        backwards = sorted((a for a in actions if a.kind == BACKWARD), key=lambda a: a.micro)
        if j == len(lists) - 1:
            after = {a.micro: a for a in backwards}
            backwards, forwards = [], [b for a in forwards for b in (a, after[a.micro])]
        transformed.append(forwards + backwards + [a for a in actions if a.kind == WEIGHT])
    clock_table(transformed)
    return transformed


register("gpipe", gpipe, one_process=True)
register("1f1b", one_f_one_b, one_process=False,
         why_not="1f1b interleaves backward with forward (B0 runs before the last forward), which needs "
                 "the loss inside the pipeline, but this Pipeline returns the output and its caller "
                 "computes the loss after forward returns")
register("zb-h1", zb_h1, one_process=False,
         why_not="zb-h1 interleaves backward with forward as 1f1b does (B0 and W0 run before the last "
                 "forward), which needs the loss inside the pipeline, but this Pipeline returns the output "
                 "and its caller computes the loss after forward returns")


register("interleaved-1f1b", interleaved_1f1b, one_process=False,
         why_not="interleaved-1f1b runs several stages per rank and interleaves backward with forward",
         virtual=VirtualRule(interleaved_1f1b, interleaved_place, interleaved_check))
register("zb-v", zb_v, one_process=False,
         why_not="zb-v runs two stages per rank and interleaves backward with forward",
         virtual=VirtualRule(zb_v, zb_v_place, zb_v_check))


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


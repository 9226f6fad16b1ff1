"""One step of one pipeline stage (``F3``, ``B3``, ``W3``) and the shapes schedules are written in.

Index names, fixed here once: ``i`` micro-batch, ``j`` stage, ``k`` clock tick, ``m`` micro-batches
(``chunks``), ``n`` stages. A schedule is a list with one entry per stage j: the ordered actions that
stage runs in one training step (``dualframe.pipeline.schedule`` builds and names them,
``dualframe.pipeline.clock`` lays them on a clock).

Kinds: ``F i`` the forward of micro-batch i; ``B i`` its backward; ``W i`` its weight gradient. A
schedule whose lists hold W actions splits the backward in two (zero-bubble schedules): ``B i`` then
computes only the gradient of the stage's input (what the previous stage waits for) and ``W i``, later,
the gradient of the stage's weights. Without W actions, ``B i`` is the whole backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dualframe.errors import ScheduleError

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
#: Every kind of action, in the order of a micro-batch's passes on one stage.
KINDS = (FORWARD, BACKWARD, WEIGHT)


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage: ``Action("F", 3)`` is the forward of micro-batch 3, shown ``F3``.

    Example:
        >>> Action.parse("B2")
        Action(kind='B', micro=2)
        >>> Action.parse("W0").kind
        'W'
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
        if len(text) < 2 or text[0] not in KINDS or not text[1:].isdigit():
            raise ScheduleError(f"an action is F<micro-batch>, B<micro-batch> or W<micro-batch> (action: {text!r})")
        return cls(text[0], int(text[1:]))


#: One ordered action list per stage: ``lists[j]`` is what stage j runs in one step.
ActionLists = List[List[Action]]
#: ``table[k][j]``: stage j's action at clock tick k, None when idle.
Table = List[List[Optional[Action]]]
#: ``(i, j)``: micro-batch i on stage j; ticks list the cells of one pass per clock tick.
Cell = Tuple[int, int]
Ticks = Tuple[Tuple[Cell, ...], ...]


def splits_backward(actions: Sequence[Action]) -> bool:
    """Whether ``actions`` (one stage's list) split the backward: ``B i`` input gradient only, ``W i`` the weights'.

    Example:
        >>> splits_backward([Action("F", 0), Action("B", 0), Action("W", 0)]), splits_backward([Action("F", 0)])
        (True, False)
    """
    return any(action.kind == WEIGHT for action in actions)

"""One step of one pipeline stage (``F3``, ``B3``, ``W3``; ``2F3`` on stage 2) and the shapes schedules are written in.

Index names, fixed here once: ``i`` micro-batch, ``j`` stage, ``k`` clock tick, ``m`` micro-batches
(``chunks``), ``n`` stages. A schedule is a list with one entry per rank: the ordered actions that
rank runs in one training step (``dualframe.pipeline.schedule`` builds and names them,
``dualframe.pipeline.clock`` lays them on a clock). An action without a stage belongs to the rank's only
stage (list j runs stage j); with virtual stages (``dualframe.pipeline.virtual``) a rank holds several and
each action names its own, as ``torch.distributed.pipelining``'s ``_Action(stage_index, kind, micro)``.

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

    ``stage``: the stage it runs on, None for the rank's only stage; ``Action("F", 3, 2)`` shows ``2F3``.

    Example:
        >>> Action.parse("B2")
        Action(kind='B', micro=2)
        >>> Action.parse("W0").kind, Action.parse("3B1").stage
        ('W', 3)
        >>> str(Action("F", 0)), str(Action("F", 0, stage=2))
        ('F0', '2F0')
    """

    kind: str
    micro: int
    stage: Optional[int] = None

    def __str__(self) -> str:
        return f"{'' if self.stage is None else self.stage}{self.kind}{self.micro}"

    def __repr__(self) -> str:
        where = "" if self.stage is None else f", stage={self.stage}"
        return f"Action(kind={self.kind!r}, micro={self.micro}{where})"

    def on(self, j: int) -> int:
        """The stage this action runs on, ``j`` (its list's stage) when it names none."""
        return j if self.stage is None else self.stage

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``"F3"`` -> ``Action("F", 3)``; ``"2F3"`` -> ``Action("F", 3, stage=2)``."""
        cut = next((k for k, c in enumerate(text) if c in KINDS), -1)
        head, tail = text[:max(cut, 0)], text[cut + 1:]
        if cut < 0 or not tail.isdigit() or (head and not head.isdigit()):
            raise ScheduleError(f"an action is F<micro-batch>, B<micro-batch> or W<micro-batch> (action: {text!r}); "
                                f"on a named stage, the stage first: 2F3")
        return cls(text[cut], int(tail), int(head) if head else None)


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


def fusable(actions: Sequence[Action]) -> List[int]:
    """Micro-batches whose backward directly follows their forward in one stage's ``actions``.

    The last stage needs no gradient from a neighbour, so such a micro-batch's forward, loss and backward
    may run as one call (all of them under 1F1B, the last one under GPipe).

    Example:
        >>> fusable([Action.parse(t) for t in "F0 F1 B1 B0".split()]), fusable([Action.parse(t) for t in "F0 B0 F1 B1".split()])
        ([1], [0, 1])
    """
    return [a.micro for a, b in zip(actions, actions[1:])
            if a.kind == FORWARD and b.kind == BACKWARD and b.micro == a.micro and b.stage == a.stage]

"""The order of messages on each link between neighbouring stages, as a schedule's action lists make it.

``link_messages`` lists what stage j sends and receives in the order it posts them; ``check_link_order``
proves both ends of every link see the same order (the wire itself is ``dualframe.pipeline.link``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from dualframe.errors import ScheduleError
from dualframe.pipeline.action import BACKWARD, FORWARD, WEIGHT, Action


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
    ``W i`` (a weight gradient) stays on its stage.
    """
    n = len(lists)
    messages = []
    for action in lists[j]:
        if action.kind == WEIGHT:
            continue
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

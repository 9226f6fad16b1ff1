"""Schedules of virtual stages, several stages per rank: interleaved 1F1B and ZB-V, their placements and rules.

Index names as in ``dualframe.pipeline.action``, plus ``p`` ranks of a pipeline, ``v`` stages per rank
(``virtual_stages``), ``r`` a rank, ``c`` a rank's chunk of the model (its c-th stage); ``n = p * v``.
Each action names its stage, so ``clock_table`` follows a micro-batch from rank to rank by stage index;
``dualframe.pipeline.schedule`` registers both with their placements and rules.

- ``"interleaved-1f1b"`` (Narayanan et al. 2021, Megatron-LM): stage j on rank ``j % p``, so a
  micro-batch visits every rank v times; each rank warms up with ``2 (p - r - 1) + (v - 1) p`` forwards,
  then alternates, in groups of p micro-batches per chunk. Needs ``chunks`` a multiple of p.
- ``"zb-v"`` (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): v = 2, rank r holds
  stages r and ``2p - 1 - r`` (a V: down the ranks and back, the loss on rank 0), the backward split
  into B (the input's gradient) and W (the weights'), W filling the ticks 1F1B leaves idle.
"""
from __future__ import annotations

from typing import List

from dualframe.errors import ChunksError, ScheduleError
from dualframe.pipeline.action import BACKWARD, FORWARD, WEIGHT, Action, ActionLists


def interleaved_place(j: int, ranks: int) -> int:
    """Interleaved 1F1B puts stage j on rank ``j % ranks``.

    Example:
        >>> [interleaved_place(j, 2) for j in range(6)]
        [0, 1, 0, 1, 0, 1]
    """
    return j % ranks


def interleaved_check(ranks: int, chunks: int, virtual_stages: int) -> None:
    """Interleaved 1F1B's rules: ``virtual_stages >= 2`` and ``chunks`` a multiple of the ranks."""
    if virtual_stages < 2:
        raise ScheduleError(f"interleaved-1f1b needs virtual_stages >= 2 (virtual_stages: {virtual_stages}); "
                            f"with one stage per rank it is schedule='1f1b'")
    if chunks % ranks:
        raise ChunksError(f"interleaved-1f1b needs chunks divisible by the pipeline's ranks, which take micro-batches "
                          f"in groups of that many (chunks: {chunks}, ranks: {ranks}); use chunks="
                          f"{max(ranks, chunks - chunks % ranks)} or {chunks + ranks - chunks % ranks}")


def interleaved_1f1b(ranks: int, chunks: int, virtual_stages: int = 2) -> ActionLists:
    """Interleaved 1F1B: rank r runs its v chunks' forwards in groups of p micro-batches, backwards likewise.

    The k-th forward of a rank is micro-batch ``(k // (p v)) p + k % p`` on its chunk ``(k // p) % v``
    (its backwards: the chunks in reverse), as Megatron-LM orders them.

    Example:
        >>> [" ".join(map(str, a)) for a in interleaved_1f1b(2, 2, 2)]
        ['0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1', '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1']
    """
    p, m, v = ranks, chunks, virtual_stages
    total = m * v

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    lists = []
    for r in range(p):
        def forward(k: int) -> Action:
            return Action(FORWARD, micro(k), ((k // p) % v) * p + r)

        def backward(k: int) -> Action:
            return Action(BACKWARD, micro(k), (v - 1 - (k // p) % v) * p + r)

        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        lists.append(actions)
    return lists


def zb_v_place(j: int, ranks: int) -> int:
    """ZB-V puts stage j on rank j going down, then on rank ``2 ranks - 1 - j`` coming back (a V).

    Example:
        >>> [zb_v_place(j, 3) for j in range(6)]
        [0, 1, 2, 2, 1, 0]
    """
    return j if j < ranks else 2 * ranks - 1 - j


def zb_v_check(ranks: int, chunks: int, virtual_stages: int) -> None:
    """ZB-V's rule: exactly two stages per rank (the V's two arms)."""
    if virtual_stages != 2:
        raise ScheduleError(f"zb-v places two stages on each rank, one per arm of its V (virtual_stages: "
                            f"{virtual_stages}); use virtual_stages=2, or schedule='interleaved-1f1b'")


def zb_v(ranks: int, chunks: int, virtual_stages: int = 2) -> ActionLists:
    """ZB-V: rank r holds stages r (down) and ``2p - 1 - r`` (back); B i and W i split as in ZB-H1.

    Warm-up: ``2 (p - r) - 1`` forwards down, r pairs (back, down), then ``p - r`` rounds of a forward
    back with its B and W; steady rounds of (F, B, W) down then back; cool-down B passes with the
    W passes of the down stage in between, the remaining W last: torch.distributed.pipelining's
    ``ScheduleZBVZeroBubble`` order, written for ``max(chunks, 2p - 1)`` micro-batches and the ones
    past ``chunks`` left out.

    Example:
        >>> [" ".join(map(str, a)) for a in zb_v(2, 2)]
        ['0F0 0F1 3F0 3B0 3W0 3F1 3B1 3W1 0B0 0W0 0B1 0W1', '1F0 2F0 1F1 2F1 2B0 2W0 1B0 1W0 2B1 2W1 1B1 1W1']
    """
    p, m = ranks, chunks
    lists = []
    for r in range(p):
        actions = [a for a in _zb_v_rank(p, max(m, 2 * p - 1), r) if a.micro < m]
        lists.append(actions)
    return lists


def _zb_v_rank(p: int, m: int, r: int) -> List[Action]:
    """Rank r's ZB-V list for m micro-batches (``m >= 2p - 1``)."""
    down, back = r, 2 * p - 1 - r
    done = {(j, kind): 0 for j in (down, back) for kind in (FORWARD, BACKWARD, WEIGHT)}
    actions: List[Action] = []

    def run(j: int, *kinds: str) -> None:
        for kind in kinds:
            actions.append(Action(kind, done[(j, kind)], j))
            done[(j, kind)] += 1

    for _ in range(2 * (p - r) - 1):
        run(down, FORWARD)
    for _ in range(r):
        run(back, FORWARD)
        run(down, FORWARD)
    for _ in range(p - r):
        run(back, FORWARD, BACKWARD, WEIGHT)
    while done[(back, FORWARD)] < done[(down, FORWARD)] or done[(down, FORWARD)] < m:
        if done[(down, FORWARD)] < m:
            run(down, FORWARD)
        run(down, BACKWARD, WEIGHT)
        run(back, FORWARD, BACKWARD, WEIGHT)
    for _ in range(r):
        run(down, BACKWARD)
        run(back, BACKWARD)
    for _ in range(p - r):
        run(down, BACKWARD, WEIGHT)
    for j in (back, down):
        while done[(j, WEIGHT)] < done[(j, BACKWARD)]:
            run(j, WEIGHT)
    return actions

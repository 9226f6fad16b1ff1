"""Every stage of a process pipeline's schedule walked in one process, for tests: the clock table's order, edges in memory."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from dualframe.pipeline.action import ActionLists
from dualframe.pipeline.clock import clock_table
from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.graph_walk import GraphStageWork, edge_pairs, graph_action, stage_edges
from dualframe.pipeline.virtual_stage import LocalLink
from dualframe.pipeline.walk import StepRecord


def walk_in_one_process(lists: ActionLists, split: GraphSplit, works: Mapping[int, GraphStageWork[Any]],
                        micro_inputs: Sequence[Any]) -> StepRecord:
    """Run every rank's actions of ``lists`` tick by tick, each with its stage's work, messages kept in memory.

    The same walk of one action as a process stage's (``graph_walk.graph_action``), each edge (p, c) a
    ``LocalLink``: a work that packs its messages packs them here too, so a step equals the process
    pipeline's. ``works[j]``: stage j's work; ``micro_inputs[i]``: micro-batch i's inputs by name.

    Example:
        >>> record = walk_in_one_process(rank_schedule("zb-v", 2, 4, 2), split, works, inputs)  # doctest: +SKIP
    """
    links = {pair: LocalLink[Any]() for pair in edge_pairs(split)}
    record = StepRecord()
    for row in clock_table(lists):
        for position, action in enumerate(row):
            if action is None:
                continue
            j = action.on(position)
            edges = stage_edges(split, j)
            peers = {peer: links[(min(j, peer), max(j, peer))] for peer in edges.sources + edges.targets}
            graph_action(action, edges, micro_inputs, works[j], peers, j == 0, record)
    return record

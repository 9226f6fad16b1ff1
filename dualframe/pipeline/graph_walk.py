"""A process pipeline over a graph split, framework-neutral: messages go along edges, producer stage -> reader stage.

In a layer pipeline stage j talks to j - 1 and j + 1 only. In a graph (``dualframe.pipeline.graph``) a
value goes from the stage that makes it straight to every stage that reads it, so stage j may
receive from several earlier stages and send to several later ones. An *edge* (p, c) carries, for
each micro-batch, one forward message holding every value c reads from p and one backward message
holding their gradients. Model inputs come from stage 0 (the rank that reads the batch); model
outputs go to the last stage (which computes the loss). Each edge is a two-rank ``StageLink``, so
the wire, the shape headers, MPI point-to-point and the bounded waits are the layer pipeline's own.

Extra dependencies along skip edges are implied by the neighbour chain (F i on stage c needs F i on
every stage before it; B i on stage p needs B i on every stage after it), so any schedule that is
deadlock-free for the layer pipeline (GPipe, 1F1B) is deadlock-free here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, TypeVar, cast

from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.link import StageLink
from dualframe.pipeline.action import FORWARD, WEIGHT, Action
from dualframe.pipeline.stage import PipelineStage
from dualframe.pipeline.walk import StageLinks, StepRecord

T = TypeVar("T")


def _source(split: GraphSplit, value: str) -> int:
    """The stage a value comes from: its producer, stage 0 for a model input."""
    return max(split.producer[value], 0)


def edge_values(split: GraphSplit, p: int, c: int) -> Tuple[str, ...]:
    """The values edge (p, c) carries, in order: what c reads from p, then the model outputs p makes for the last stage.

    Example:
        >>> from dualframe.pipeline.graph import Graph, GraphNode, cut_graph
        >>> g = Graph(("x", "mask"), (GraphNode("a", "a", ("x",), ("h",)), GraphNode("b", "b", ("h", "mask"), ("y",)),
        ...                           GraphNode("c", "c", ("y", "h"), ("z",))), ("z",))
        >>> s = cut_graph(g, split_points=["b", "c"])
        >>> edge_values(s, 0, 1), edge_values(s, 0, 2), edge_values(s, 1, 2)
        (('h', 'mask'), ('h',), ('y',))
    """
    last = split.stages - 1
    values = [v for v in split.reads[c] if _source(split, v) == p]
    if c == last and p != last:
        values += [v for v in split.outputs_from(p) if v not in values]
    if c == last and p == 0:
        values += [v for v in split.graph.outputs if split.producer[v] < 0 and v not in values]
    return tuple(values)


@dataclass(frozen=True)
class Edges:
    """Stage j's edges: the stages it receives forward messages from and sends them to, ascending."""

    sources: Tuple[int, ...]
    targets: Tuple[int, ...]


def stage_edges(split: GraphSplit, j: int) -> Edges:
    """Which stages stage ``j`` exchanges messages with (edges carrying no value are left out)."""
    n = split.stages
    return Edges(tuple(p for p in range(j) if edge_values(split, p, j)),
                 tuple(c for c in range(j + 1, n) if edge_values(split, j, c)))


def edge_pairs(split: GraphSplit) -> List[Tuple[int, int]]:
    """Every edge (p, c) of the split, p < c."""
    return [(p, c) for c in range(split.stages) for p in range(c) if edge_values(split, p, c)]


class GraphStageWork(Protocol[T]):
    """The stage's computation on one micro-batch, its messages packed per edge (the framework's part)."""

    def forward(self, i: int, received: Mapping[int, T]) -> Dict[int, T]:
        """Run micro-batch i from the messages of each source stage (key -1: the inputs, on stage 0).

        Returns one message per target stage."""

    def backward(self, i: int, grads: Mapping[int, T]) -> Dict[int, T]:
        """Backward of micro-batch i from the gradient messages of each target stage (none on the last stage).

        Returns one gradient message per source stage. With a split backward (the schedule has W
        actions) only the gradients those messages carry; the weights' wait for ``weight``."""


class SplitGraphStageWork(GraphStageWork[T], Protocol):
    """A ``GraphStageWork`` that can split its backward, for zero-bubble schedules (``W`` actions)."""

    def weight(self, i: int) -> None:
        """The weights' gradient of micro-batch i (W i), after its backward computed the inputs'."""


def graph_walk(actions: Sequence[Action], edges: Edges, inputs: Sequence[Any], work: "GraphStageWork[T]",
               links: Mapping[int, "StageLinks[T]"], first: bool,
               clock: Callable[[], float] = time.perf_counter) -> StepRecord:
    """Run a stage's actions in order, exchanging messages along its edges (``links`` by peer stage)."""
    record = StepRecord(start=clock())
    for action in actions:
        graph_action(action, edges, inputs, work, links, first, record, clock)
    record.end = clock()
    return record


def graph_action(action: Action, edges: Edges, inputs: Sequence[Any], work: "GraphStageWork[T]",
                 links: Mapping[int, "StageLinks[T]"], first: bool, record: StepRecord,
                 clock: Callable[[], float] = time.perf_counter) -> None:
    """Run one action of a graph stage: receive along its edges, compute, send along them; time it in ``record``.

    The message tags name the micro-batch only (``F3``): each edge has its own link.
    """
    i, tag = action.micro, f"{action.kind}{action.micro}"
    if action.kind == FORWARD:
        received: Dict[int, Any] = {p: links[p].receive(tag) for p in edges.sources}
        if first:
            received[-1] = inputs[i]
        begin = clock()
        sends = work.forward(i, received)
        record.actions.append((str(action), begin, clock()))
        for c in edges.targets:
            links[c].send(tag, sends[c])
    elif action.kind == WEIGHT:
        begin = clock()
        cast("SplitGraphStageWork[T]", work).weight(i)  # lists with W come with a split work
        record.actions.append((str(action), begin, clock()))
    else:
        grads = {c: links[c].receive(tag) for c in edges.targets}
        begin = clock()
        back = work.backward(i, grads)
        record.actions.append((str(action), begin, clock()))
        for p in edges.sources:
            links[p].send(tag, back[p])


class GraphPipelineStage(PipelineStage[T]):
    """A ``PipelineStage`` whose step exchanges messages along the graph's edges (one two-rank link per edge).

    The neighbour link of the base class names the step's agreement and loss; no activation travels on it.

    Example:
        >>> stage = GraphPipelineStage(layout, wire, hvd.rank(), sets, "dpipe0", split=split)  # doctest: +SKIP
        >>> record = stage.step(stage.actions, micro_inputs, work, train=True)                   # doctest: +SKIP
    """

    def __init__(self, layout: Any, wire: Any, rank: int, sets: Dict[Tuple[int, ...], Any], prefix: str,
                 step_names: bool = True, direct: Optional[Any] = None, device: Any = None, backend: Any = None,
                 *, split: GraphSplit) -> None:
        super().__init__(layout, wire, rank, sets, prefix, step_names, direct, device, backend)
        self.edges = stage_edges(split, self.index)
        ranks = self.pipeline_ranks
        self.edge_links: Dict[int, StageLink[T]] = {}
        for peer in self.edges.sources + self.edges.targets:
            p, c = min(peer, self.index), max(peer, self.index)
            self.edge_links[peer] = StageLink(wire, 0 if self.index == p else 1, [ranks[p], ranks[c]], rank, sets,
                                              f"{prefix}.e{p}_{c}", layout.timeout, step_names, direct)

    def step(self, actions: Sequence[Action], micro_inputs: Sequence[Any], work: Any, train: bool) -> StepRecord:
        """Walk ``actions`` on the agreed batch along the edges; keep its record."""
        links = [self.link, *self.edge_links.values()]
        for link in links:
            link.begin(self._key, backward=train, chunks=self.layout.chunks)
        record = graph_walk(actions, self.edges, micro_inputs, work, self.edge_links, self.is_first)
        for link in links:
            link.finish()
        self.records.add(record)
        return record


def edge_process_sets(split: GraphSplit, pipeline_groups: Sequence[Sequence[int]]) -> List[List[int]]:
    """The two-rank groups of every edge in every pipeline replica (declare them with the pipeline's own sets).

    Example:
        >>> from dualframe.pipeline.graph import Graph, GraphNode, cut_graph
        >>> g = Graph(("x",), (GraphNode("a", "a", ("x",), ("h",)), GraphNode("b", "b", ("h",), ("y",)),
        ...                    GraphNode("c", "c", ("y", "h"), ("z",))), ("z",))
        >>> edge_process_sets(cut_graph(g, split_points=["b", "c"]), [[0, 1, 2]])
        [[0, 1], [0, 2], [1, 2]]
    """
    groups: List[List[int]] = []
    for ranks in pipeline_groups:
        for p, c in edge_pairs(split):
            pair = sorted((ranks[p], ranks[c]))
            if pair not in groups:
                groups.append(pair)
    return groups

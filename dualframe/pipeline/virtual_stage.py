"""One rank's several stages of a process pipeline (virtual stages), framework-neutral: their links and their step.

With ``virtual_stages`` v > 1 the rank at position r of a pipeline holds the stages the schedule places
there (``StageLayout.held``), and each of its actions names its stage (``2F3``). Every edge (p, c) of the
model's graph split that touches this rank's stages (a chain's: (j - 1, j)) gets its own link: a two-rank
``StageLink`` numbering its point-to-point messages in its own block (``link.virtual_tag_offset``), or,
where both stages live on this rank (ZB-V's turn at the bottom of its V), a hand-over in memory. Each
action is walked with the graph walk's step (``graph_walk.graph_action``) on its stage's edges and work.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Generic, List, Mapping, Sequence, TypeVar, Union

from dualframe.pipeline.action import FORWARD, Action
from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.graph_walk import GraphStageWork, edge_pairs, graph_action, stage_edges
from dualframe.pipeline.link import StageLink, virtual_tag_offset
from dualframe.pipeline.stage import PipelineStage
from dualframe.pipeline.walk import StepRecord

T = TypeVar("T")


class LocalLink(Generic[T]):
    """The boundary between two stages on one rank: a message is handed over in memory.

    Example:
        >>> link = LocalLink(); link.send("F0", "x"); link.receive("F0")
        'x'
    """

    def __init__(self) -> None:
        self._held: Dict[str, T] = {}

    def begin(self, key: Any, backward: bool, chunks: int) -> None:
        """Nothing to post ahead in memory."""

    def send(self, tag: str, tensor: T) -> None:
        """Keep ``tensor`` for the stage that receives ``tag``."""
        self._held[tag] = tensor

    def receive(self, tag: str) -> T:
        """The tensor sent as ``tag`` (the schedule runs the sender first: ``clock_table`` proves it)."""
        return self._held.pop(tag)

    def finish(self) -> None:
        """Drop what a failed step left behind."""
        self._held.clear()


class VirtualGraphStage(PipelineStage[T]):
    """A rank holding several stages (``layout.held``) of a graph split: one link per edge (p, c) touching them.

    Each edge gets its own link (``_pair_link``, numbered by the edge's place in ``edge_pairs``), so the
    walk of one action is the graph walk's (``graph_walk.graph_action``) with that stage's edges and work.
    The base class's neighbour link names the step's agreement and loss; no activation travels on it.

    Example:
        >>> role = open_stage(BACKEND, layout, split=split)  # a layout of virtual_stages=2     # doctest: +SKIP
        >>> role.held, role.is_first, role.is_last                                              # doctest: +SKIP
        ([0, 3], True, True)
        >>> record = role.step(role.actions, micro_inputs, works, train=True)  # works: {j: ...}  # doctest: +SKIP
    """

    def __init__(self, *args: Any, split: GraphSplit, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        layout = self.layout
        self.held: List[int] = layout.held(self.index)
        self.total = len(layout.ranges)
        self.loss_rank = self.pipeline_ranks[layout.placement[-1]]
        self.edges = {j: stage_edges(split, j) for j in self.held}
        self.edge_links = {(p, c): self._pair_link(p, c, k, f"e{p}_{c}") for k, (p, c) in enumerate(edge_pairs(split))
                           if layout.placement[p] == self.index or layout.placement[c] == self.index}

    def _pair_link(self, p: int, c: int, block: int, name: str) -> "Union[StageLink[T], LocalLink[T]]":
        """The link from stage p to stage c (one of them here): in memory on one rank, else a two-rank link.

        ``block``: its point-to-point numbers' block (``link.virtual_tag_offset``), one per link of the pipeline.
        """
        layout, ranks = self.layout, self.pipeline_ranks
        a, c_rank = layout.placement[p], layout.placement[c]
        if a == c_rank:
            return LocalLink()
        return StageLink(self.wire, 0 if self.index == a else 1, [ranks[a], ranks[c_rank]], self.rank, self.sets,
                         f"{self.link.prefix}.{name}", layout.timeout, self.link.step_names, self.direct,
                         tag_offset=virtual_tag_offset(block, layout.chunks))

    @property
    def is_first(self) -> bool:
        """True on the rank holding stage 0 (it reads the inputs)."""
        return 0 in self.held

    @property
    def is_last(self) -> bool:
        """True on the rank holding the last stage (it reads the targets and computes the loss)."""
        return self.total - 1 in self.held

    def forward_actions(self, chunks: int) -> List[Action]:
        """Inference: every forward of this rank's stages, stage by stage (each waits only on lower stages)."""
        return [Action(FORWARD, i, j) for j in self.held for i in range(chunks)]

    def step(self, actions: Sequence[Action], micro_inputs: Sequence[T],
             work: "Mapping[int, GraphStageWork[T]]", train: bool) -> StepRecord:
        """Walk ``actions`` (each naming its stage; ``work[j]`` runs stage j's nodes) along the edges' links."""
        works = work
        links: List[Any] = [self.link, *self.edge_links.values()]
        for link in links:
            link.begin(self._key, backward=train, chunks=self.layout.chunks)
        record = StepRecord(start=time.perf_counter())
        for action in actions:
            j = action.on(self.index)
            edges = self.edges[j]
            peers = {peer: self.edge_links[(min(j, peer), max(j, peer))] for peer in edges.sources + edges.targets}
            graph_action(action, edges, micro_inputs, works[j], peers, j == 0, record)
        record.end = time.perf_counter()
        for link in links:
            link.finish()
        self.records.add(record)
        return record

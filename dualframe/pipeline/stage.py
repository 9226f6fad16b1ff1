"""One rank's stage of a process pipeline, framework-neutral: its role, its step (agreement, walk, loss) and timing.

Both adapters' ``DistributedPipeline`` keep one ``PipelineStage``: it knows which replica and stage
this rank holds, its actions, its neighbours and process sets, and runs a step the same way on
every framework: agree on the batch (``walk.step_agreement``), walk the actions along the model's
graph edges (``graph_walk.GraphPipelineStage``, ``virtual_stage.VirtualGraphStage``: a chain's edges run
j - 1 -> j), reduce the loss. The adapter supplies the ``Wire`` and the stage's work on tensors.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar

from dualframe.backend import Backend, PointToPoint, Wire
from dualframe.errors import ScheduleError
from dualframe.pipeline.action import FORWARD, Action, splits_backward
from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.link import StageLink, control_tag
from dualframe.pipeline.walk import RecordBook, StepRecord, pipeline_bubble, read_agreement, step_agreement
from dualframe.pipeline.layout import DTYPE_NAMES, StageLayout, pipeline_process_sets

T = TypeVar("T")
_INT64, _FLOAT64 = DTYPE_NAMES.index("int64"), DTYPE_NAMES.index("float64")

#: What one rank contributes to ``timing_report``: (replica, its timing line, mean busy s, mean step s).
TimingFacts = Tuple[int, str, float, float]


def timing_report(gathered: Sequence[TimingFacts]) -> List[str]:
    """Every rank's timing line in rank order, then each replica's step and bubble over its whole pipeline.

    A stage's own bubble ends when that stage finishes; the replica line uses
    ``walk.pipeline_bubble``, the share that GPipe's (n-1)/(m+n-1) counts.

    Example:
        >>> timing_report([(0, "stage 0 ...", 3.0, 6.0), (0, "stage 1 ...", 3.0, 4.0)])[-1]
        'replica 0 pipeline: step 6000.0 ms, bubble 50.0%'
    """
    lines = [line for _, line, _, _ in gathered]
    for replica in sorted({facts[0] for facts in gathered}):
        busy = [b for r, _, b, _ in gathered if r == replica]
        walls = [w for r, _, _, w in gathered if r == replica]
        if max(walls) > 0:
            lines.append(f"replica {replica} pipeline: step {max(walls) * 1e3:.1f} ms, "
                         f"bubble {pipeline_bubble(busy, walls):.1%}")
    return lines


class PipelineStage(Generic[T]):
    """Rank ``rank``'s place in a checked pipeline layout, and its step over a framework's wire.

    Args:
        layout: the checked arguments (``stage_setup.layout_pipeline``).
        wire: the framework's tensor and Horovod calls.
        rank: this process's Horovod rank.
        sets: Horovod process sets by sorted ranks (``stage_setup.resolve_process_sets``).
        prefix: the pipeline's name in its Horovod operations.
        step_names: whether operation names carry the step number (see ``StageLink``).
        direct: point-to-point (MPI or ZeroMQ) for the activations and gradients (see ``StageLink``); None: Horovod broadcasts.
        device: the framework's device of this stage (``Placement.device``), kept for the adapter.
        backend: the adapter's ``Backend`` (its batch split and collectives); None where only ``step`` runs.

    Example:
        >>> stage = PipelineStage(layout, wire, hvd.rank(), sets, "dpipe0")        # doctest: +SKIP
        >>> sizes = stage.agree(x, y, train=True)                                   # doctest: +SKIP
        >>> record = stage.step(stage.actions, micro_inputs, work, train=True)  # a GraphPipelineStage  # doctest: +SKIP
        >>> loss = stage.mean_loss(work.loss_sum)                                   # doctest: +SKIP
    """

    def __init__(self, layout: StageLayout, wire: "Wire[T]", rank: int, sets: Dict[Tuple[int, ...], Any],
                 prefix: str, step_names: bool = True, direct: "Optional[PointToPoint[T]]" = None,
                 device: Any = None, backend: "Optional[Backend[T]]" = None) -> None:
        grid = layout.grid
        self.layout, self.wire, self.rank, self.direct, self.device = layout, wire, rank, direct, device
        self.backend = backend
        self.replica, self.index = grid.position(rank)
        self.stages, self.actions = grid.stages, layout.actions[self.index]
        self.pipeline_ranks = grid.pipeline_groups[self.replica]
        self.stage_ranks = grid.stage_groups[self.index]
        everyone = sets[tuple(range(grid.replicas * grid.stages))]  # Horovod's global set
        self.pipeline_set = sets.get(tuple(self.pipeline_ranks), everyone)
        self.stage_process_set = sets.get(tuple(self.stage_ranks)) if grid.replicas > 1 else None
        self.sets = sets
        self.link = StageLink(wire, self.index, self.pipeline_ranks, rank, sets, prefix, layout.timeout, step_names,
                              direct)
        self.records = RecordBook()
        self._key: Any = None
        self.loss_rank = self.pipeline_ranks[-1]  # the rank holding the last stage, which computes the loss

    @property
    def is_first(self) -> bool:
        """True on the rank holding stage 0 (it reads the inputs)."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """True on the rank holding the last stage (it reads the targets and computes the loss)."""
        return self.index == self.stages - 1

    def agree(self, inputs: Optional[T], targets: Optional[T], train: bool, own_loss: bool = False) -> List[int]:
        """Agree over the pipeline on the batch; return the micro-batch sizes.

        One small sum over the pipeline's ranks: over its point-to-point transport where it has one
        (``_direct_sum``), else a Horovod allreduce. ``own_loss``: the model computes its loss from its
        inputs' labels; targets are then refused rather than needed.

        Raises:
            ChunksError, StrategyError: a bad batch, on every stage of the pipeline alike.
        """
        shape: Optional[Tuple[int, ...]] = None
        code, rows = 0, (None if train and not own_loss else 0)
        if self.is_first and inputs is not None:
            shape, code = self.wire.describe(inputs)
        if train and self.is_last and targets is not None:
            dims = self.wire.describe(targets)[0]
            rows = dims[0] if dims else None
        mine = self.wire.tensor(step_agreement(shape, code, rows, self.is_first, self.is_last), _INT64)
        what = f"starting step {self.link.step}"
        if self.direct is not None:
            summed = self._direct_sum(mine, _INT64, what)
        else:
            handle = self.wire.allreduce(mine, "sum", self.link.name("agree"), self.pipeline_set)
            summed = self.wire.values(self.link.wait(handle, what))
        shape, code, sizes = read_agreement(summed, self.layout.chunks, need_targets=train and not own_loss,
                                            own_loss=train and own_loss)
        self._key = (shape, code)
        return sizes

    def forward_actions(self, chunks: int) -> List[Action]:
        """Inference: this rank's forwards of ``chunks`` micro-batches, in order."""
        return [Action(FORWARD, i) for i in range(chunks)]

    def micro_batches(self, inputs: Optional[T], targets: Optional[T], sizes: Sequence[int],
                      train: bool) -> Tuple[List[T], List[T]]:
        """The agreed micro-batches: of the inputs on the first stage, of the targets on the last when training."""
        if self.backend is None:
            raise ValueError("micro_batches needs a stage opened with open_stage (it splits with the backend)")
        split = self.backend.batches.split
        micro_inputs = split(inputs, sizes) if self.is_first and inputs is not None else []
        micro_targets = split(targets, sizes) if self.is_last and train and targets is not None else []
        return micro_inputs, micro_targets

    def step(self, actions: Sequence[Action], micro_inputs: Sequence[Any], work: Any, train: bool) -> StepRecord:
        """Walk ``actions`` on the agreed batch along the model's edges; keep its record.

        The walk is the graph walk's: ``graph_walk.GraphPipelineStage`` (one stage) and
        ``virtual_stage.VirtualGraphStage`` (several) are what ``open_stage`` opens.
        """
        raise NotImplementedError("open_stage opens a GraphPipelineStage or a VirtualGraphStage, which walk")

    def mean_loss(self, loss_sum: float) -> float:
        """The step's mean loss (the last stage's ``loss_sum``, averaged over replicas) on every rank of the pipeline.

        The replicas' average is a Horovod allreduce; the last stage then sends it to the others over the
        pipeline's point-to-point transport where it has one, else in a Horovod broadcast.
        """
        loss = self.wire.tensor([loss_sum if self.is_last else 0.0], _FLOAT64)
        name = self.link.name("loss")
        if self.is_last and self.stage_process_set is not None:
            handle = self.wire.allreduce(loss, "average", name + ".replicas", self.stage_process_set)
            loss = self.link.wait(handle, "averaging the loss")
        if self.direct is not None:
            return float(self._direct_loss(loss))
        handle = self.wire.broadcast(loss, self.loss_rank, name, self.pipeline_set)
        return float(self.wire.values(self.link.wait(handle, "waiting for the loss"))[0])

    def _others(self) -> List[int]:
        return [peer for peer in self.pipeline_ranks if peer != self.rank]

    def _post_to_others(self, tensor: T, tag: int) -> List[Any]:
        """Start sending ``tensor`` as ``tag`` to every other rank of the pipeline over point-to-point."""
        assert self.direct is not None
        return [self.direct.send(tensor, peer, tag) for peer in self._others()]

    def _delivered(self, sends: Sequence[Any], what: str) -> None:
        assert self.direct is not None
        for handle in sends:
            self.link.wait(handle, what, self.direct)

    def _receive(self, dims: Tuple[int, ...], code: int, peer: int, tag: int, what: str) -> List[Any]:
        """The values of the ``tag`` message from ``peer`` over point-to-point (a bounded wait)."""
        assert self.direct is not None
        handle = self.direct.receive(self.wire.empty(dims, code), peer, tag)
        return self.wire.values(self.link.wait(handle, what, self.direct))

    def _direct_sum(self, mine: T, code: int, what: str) -> List[Any]:
        """``mine`` summed over the pipeline's ranks through point-to-point: each rank sends its own to every other.

        The step's agreement over the pipeline's transport instead of a Horovod allreduce, which waits
        for Horovod's background thread (a cycle, 5 ms under Gloo) on every rank; a pipeline has
        few stages, so n - 1 small messages per rank cost less. Every rank posts its sends before it
        waits for any receive, so no two ranks wait on each other.
        """
        tag = control_tag("agree", self.layout.chunks)
        sends = self._post_to_others(mine, tag)
        total = list(self.wire.values(mine))
        for peer in self._others():
            theirs = self._receive((len(total),), code, peer, tag, f"{what}: waiting for rank {peer}")
            total = [a + b for a, b in zip(total, theirs)]
        self._delivered(sends, f"{what}: sending to the pipeline")
        return total

    def _direct_loss(self, loss: T) -> Any:
        """The last stage's loss sent to every other stage through point-to-point (a broadcast's result)."""
        tag, last = control_tag("loss", self.layout.chunks), self.loss_rank
        if self.is_last:
            self._delivered(self._post_to_others(loss, tag), "sending the loss")
            return self.wire.values(loss)[0]
        return self._receive((1,), _FLOAT64, last, tag, f"waiting for the loss from rank {last}")[0]

    def timing(self) -> str:
        """One line for this stage: mean step seconds, computing seconds and idle share (the bubble)."""
        book = self.records
        return (f"replica {self.replica} stage {self.index} (rank {self.rank}): step "
                f"{book.mean_wall() * 1e3:.1f} ms, busy {book.mean_busy() * 1e3:.1f} ms, idle {book.mean_bubble():.1%}")


_IDS = itertools.count()


def open_stage(backend: "Backend[T]", layout: StageLayout, step_names: bool = True, *,
               split: GraphSplit, transport: Optional[str] = None, tied: Sequence[Any] = ()) -> "PipelineStage[T]":
    """This rank's stage of a checked pipeline layout, opened over ``backend``: the first communication.

    Declares (or finds) the pipeline's process sets, places the stage on its device, agrees on the
    transport (MPI or ZeroMQ point-to-point, or Horovod broadcasts; a collective) and names the pipeline
    ``dpipe<k>``, the same ``k`` on every rank (pipelines are built in the same order everywhere).

    Args:
        backend: the adapter's ``Backend``.
        layout: ``layout_pipeline``'s checked arguments (every rank checked them before this call).
        step_names: see ``StageLink`` (TensorFlow passes False).
        split: the model's ``GraphSplit`` (a chain's: ``graph.chain_split``): the stage's values go along
            its edges, each edge's pair of ranks with a process set too.
        transport: the pipeline's checked ``transport=`` (``link.check_transport``); None reads
            ``DUALFRAME_PIPELINE_TRANSPORT``.
        tied: the model's ``tied.TiedWeight``s: their holders' groups are declared with the pipeline's sets.

    Example:
        >>> role = open_stage(BACKEND, layout_pipeline(4, [2, 2], 4, world_size=2), split=chain_split(2))  # doctest: +SKIP
        >>> role.index, role.device                                                  # doctest: +SKIP
    """
    if not backend.split_backward and any(splits_backward(actions) for actions in layout.actions):
        raise ScheduleError(
            f"schedule {layout.schedule!r} splits the backward into B (input gradient) and W (weight gradient), "
            f"which {backend.name}'s process pipeline does not run yet; use schedule='1f1b' or 'gpipe' here")
    grid = layout.grid
    world = grid.replicas * grid.stages
    needed = pipeline_process_sets(world, grid.stages)
    if layout.virtual_stages == 1:  # a value skipping stages goes straight to its reader
        from dualframe.pipeline.graph_walk import edge_process_sets

        needed += [g for g in edge_process_sets(split, grid.pipeline_groups) if g not in needed and len(g) < world]
    if layout.virtual_stages > 1:  # interleaved stages wrap from the last rank to the first: that pair too
        needed += [g for g in virtual_process_sets(layout, split) if g not in needed and len(g) < world]
    if tied:
        from dualframe.pipeline.tied import tied_process_sets

        needed += [g for g in tied_process_sets(tied, grid) if g not in needed]
    sets = backend.process_sets(needed)
    rank = backend.collectives.rank()
    j = grid.position(rank)[1]
    device = backend.placement.device(layout.devices[j] if layout.devices else None)
    prefix = f"dpipe{next(_IDS)}"
    # Virtual stages number each link's messages in its own block: MPI's tag bound must reach the last.
    from dualframe.pipeline.graph_walk import edge_pairs

    blocks = len(edge_pairs(split))
    tag_chunks = layout.chunks if layout.virtual_stages == 1 else blocks * (layout.chunks + 1)
    direct = backend.point_to_point(device, tag_chunks, prefix, transport)  # None: messages go as Horovod broadcasts
    wire = backend.wire(device)
    if layout.virtual_stages > 1:
        from dualframe.pipeline.virtual_stage import VirtualGraphStage

        return VirtualGraphStage(layout, wire, rank, sets, prefix, step_names, direct, device, backend, split=split)
    from dualframe.pipeline.graph_walk import GraphPipelineStage

    return GraphPipelineStage(layout, wire, rank, sets, prefix, step_names, direct, device, backend, split=split)


def virtual_process_sets(layout: StageLayout, split: GraphSplit) -> List[List[int]]:
    """The two-rank groups of every edge between stages on different ranks, in every replica.

    Example:
        >>> from dualframe.pipeline.graph import chain_split
        >>> from dualframe.pipeline.layout import layout_pipeline
        >>> virtual_process_sets(layout_pipeline(6, [1] * 6, 3, "interleaved-1f1b", world=3, virtual_stages=2),
        ...                      chain_split(6))
        [[0, 1], [1, 2], [0, 2]]
    """
    from dualframe.pipeline.graph_walk import edge_pairs

    groups: List[List[int]] = []
    for ranks in layout.grid.pipeline_groups:
        for p, c in edge_pairs(split):
            a, b = layout.placement[p], layout.placement[c]
            pair = sorted((ranks[a], ranks[b]))
            if a != b and pair not in groups:
                groups.append(pair)
    return groups

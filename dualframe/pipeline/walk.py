"""What one pipeline stage's step leaves behind and agrees on, framework-neutral: its record, timing and agreement.

A stage process runs its list from ``dualframe.pipeline.schedule`` in order along the graph's edges
(``dualframe.pipeline.graph_walk``; a chain of layers is a graph whose edges run j - 1 -> j). This module
holds what every walk shares: the messages' ``StageLinks`` protocol, each step's ``StepRecord`` and the
``RecordBook`` of the last ones, the pipeline's bubble, and the step agreement checked before any
micro-batch moves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Sequence, Tuple, TypeVar

from dualframe.errors import ChunksError, StrategyError
from dualframe.pipeline.layout import MAX_DIMS
from dualframe.pipeline.microbatch import micro_batch_sizes

T = TypeVar("T")


class StageLinks(Protocol[T]):
    """Messages to and from the neighbouring stages, tagged ``"F3"`` (activation) or ``"B3"`` (gradient)."""

    def receive(self, tag: str) -> T:
        """Wait for the message ``tag`` from the neighbour that sends it."""

    def send(self, tag: str, tensor: T) -> None:
        """Send ``tensor`` as ``tag`` to the neighbour that receives it (may return before delivery)."""


@dataclass
class StepRecord:
    """What one stage did in one step: each action with its start and end (seconds), and the wall time.

    Example:
        >>> record = StepRecord(start=0.0, end=4.0, actions=[("F0", 0.0, 1.0), ("B0", 2.0, 3.0)])
        >>> record.busy, record.bubble
        (2.0, 0.5)
    """

    start: float = 0.0
    end: float = 0.0
    actions: List[Tuple[str, float, float]] = field(default_factory=list)

    @property
    def wall(self) -> float:
        """Seconds from the step's start to its end on this stage."""
        return self.end - self.start

    @property
    def busy(self) -> float:
        """Seconds spent computing (forward and backward), not waiting for neighbours."""
        return sum(end - start for _, start, end in self.actions)

    @property
    def bubble(self) -> float:
        """Share of the step this stage was idle (waiting): ``1 - busy / wall``."""
        return 1.0 - self.busy / self.wall if self.wall > 0 else 0.0


class RecordBook:
    """The last steps' StepRecords of one stage, for per-stage timing and the measured bubble.

    Example:
        >>> book = RecordBook(keep=2)
        >>> for k in range(3): book.add(StepRecord(0.0, 2.0, [("F0", 0.0, 1.0)]))
        >>> len(book.records), book.mean_bubble()
        (2, 0.5)
    """

    def __init__(self, keep: int = 100) -> None:
        self.keep = keep
        self.records: List[StepRecord] = []

    def add(self, record: StepRecord) -> None:
        """Keep ``record``, dropping the oldest beyond ``keep``."""
        self.records = (self.records + [record])[-self.keep:]

    def _measured(self) -> List[StepRecord]:
        # The first step pays one-off costs (allocator, autograd start-up, shape headers): left out.
        return self.records[1:] if len(self.records) > 1 else self.records

    def mean_bubble(self) -> float:
        """Mean idle share over the kept steps (the first left out when there are more)."""
        kept = self._measured()
        return sum(r.bubble for r in kept) / len(kept) if kept else 0.0

    def mean_wall(self) -> float:
        """Mean step seconds over the kept steps (the first left out when there are more)."""
        kept = self._measured()
        return sum(r.wall for r in kept) / len(kept) if kept else 0.0

    def mean_busy(self) -> float:
        """Mean computing seconds per step over the kept steps (the first left out when there are more)."""
        kept = self._measured()
        return sum(r.busy for r in kept) / len(kept) if kept else 0.0


def pipeline_bubble(busy: Sequence[float], walls: Sequence[float]) -> float:
    """Idle share of the whole pipeline's step, from every stage's mean computing and step seconds.

    ``1 - mean(busy) / max(walls)``: the definition GPipe's (n-1)/(m+n-1) counts (the same as
    ``dualframe.observe.timeline.measured_bubble`` in one process). A stage's own ``bubble`` ends when that
    stage finishes; under GPipe the last stage finishes its backward passes while the first still
    runs its own, so its own figure leaves out the idle tail. The stages start a step together
    (after the step agreement), so the longest stage step is the pipeline's.

    Example:
        >>> pipeline_bubble([3.0, 3.0], [6.0, 4.0])   # m = 1, n = 2, a backward costing two forwards
        0.5

    Raises:
        StrategyError: no stages, different numbers of busy and step figures, or a step of 0 s.
    """
    if not busy or len(busy) != len(walls):
        raise StrategyError(f"pipeline_bubble needs one busy and one step figure per stage "
                            f"(busy: {len(busy)}, walls: {len(walls)})")
    span = max(walls)
    if span <= 0:
        raise StrategyError(f"pipeline_bubble needs a step longer than 0 s (walls: {list(walls)})")
    return 1.0 - sum(busy) / len(busy) / span


_MISSING, _TOO_MANY_DIMS = 1, 2
AGREEMENT_LENGTH = MAX_DIMS + 5


def step_agreement(shape: Optional[Sequence[int]], dtype_code: int, target_rows: Optional[int],
                   first: bool, last: bool) -> List[int]:
    """This rank's share of the step agreement, summed over the pipeline before any micro-batch moves.

    The first stage writes the input's shape and dtype, the last stage its targets' rows; the sum
    gives every stage the same facts, so every stage refuses bad input with the same error and
    none is left waiting. Fields: [input status, ndim, dims x MAX_DIMS, dtype, target status, rows].
    """
    fields = [0] * AGREEMENT_LENGTH
    if first:
        if shape is None:
            fields[0] = _MISSING
        elif len(shape) > MAX_DIMS or len(shape) == 0:
            fields[0], fields[1] = _TOO_MANY_DIMS, len(shape)
        else:
            fields[1] = len(shape)
            fields[2:2 + len(shape)] = list(shape)
            fields[2 + MAX_DIMS] = dtype_code
    if last:
        fields[3 + MAX_DIMS] = _MISSING if target_rows is None else 0
        fields[4 + MAX_DIMS] = target_rows or 0
    return fields


def read_agreement(fields: Sequence[int], chunks: int, need_targets: bool,
                   own_loss: bool = False) -> Tuple[Tuple[int, ...], int, List[int]]:
    """Check the summed agreement and return (input shape, dtype code, micro-batch sizes).

    ``own_loss``: the model computes its loss from labels among its inputs, so targets must be left out.

    Raises:
        StrategyError: no inputs on the first stage, a 0-d or over-8-d input, missing or mismatched targets,
            targets given to a model that computes its own loss.
        ChunksError: a batch smaller than ``chunks``.
    """
    status, ndim = int(fields[0]), int(fields[1])
    if status == _MISSING:
        raise StrategyError("the first stage of the pipeline got inputs=None; pass the mini-batch there")
    if status == _TOO_MANY_DIMS:
        raise StrategyError(f"inputs must have 1 to {MAX_DIMS} dimensions, batch first (inputs.ndim: {ndim})")
    shape = tuple(int(d) for d in fields[2:2 + ndim])
    sizes = micro_batch_sizes(shape[0], chunks)
    if own_loss and int(fields[4 + MAX_DIMS]):
        raise StrategyError("the last stage got targets, but the loss is the model's own (loss_fn=None), computed "
                            "from the labels among its inputs (train_step({..., 'labels': y})); leave targets out, "
                            "or pass a loss_fn")
    if need_targets:
        if int(fields[3 + MAX_DIMS]) == _MISSING:
            raise StrategyError("the last stage of the pipeline got targets=None; pass the targets there")
        if int(fields[4 + MAX_DIMS]) != shape[0]:
            raise ChunksError(
                f"targets must have one row per input row (inputs: {shape[0]} rows, "
                f"targets: {int(fields[4 + MAX_DIMS])} rows)"
            )
    return shape, int(fields[2 + MAX_DIMS]), sizes

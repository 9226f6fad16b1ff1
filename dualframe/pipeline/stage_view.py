"""What both adapters' ``DistributedPipeline`` show of their stage (``self.role``): read-only facts and timings."""
from __future__ import annotations

from typing import Any, List

from dualframe.pipeline.action import Action
from dualframe.pipeline.stage import PipelineStage, TimingFacts, timing_report
from dualframe.pipeline.walk import RecordBook


class StageView:
    """What both adapters' ``DistributedPipeline`` show of their ``PipelineStage`` (``self.role``): read-only facts.

    Example:
        >>> class DistributedPipeline(StageView):                       # doctest: +SKIP
        ...     def __init__(self, ...): self.role = PipelineStage(...)
        >>> pipe.stage_index, pipe.is_last, pipe.timing()                 # doctest: +SKIP
    """

    role: "PipelineStage[Any]"

    @property
    def replica(self) -> int:
        """The pipeline replica this rank belongs to."""
        return self.role.replica

    @property
    def stage_index(self) -> int:
        """j: the stage this rank holds (with virtual stages: its position in the pipeline, ``held_stages`` its stages)."""
        return self.role.index

    @property
    def stages(self) -> int:
        """n: stages per pipeline."""
        return self.role.stages

    @property
    def actions(self) -> List[Action]:
        """This stage's actions in one training step."""
        return self.role.actions

    @property
    def is_first(self) -> bool:
        """True on the rank holding stage 0 (it reads the inputs)."""
        return self.role.is_first

    @property
    def is_last(self) -> bool:
        """True on the rank holding the last stage (it reads the targets and computes the loss)."""
        return self.role.is_last

    @property
    def records(self) -> RecordBook:
        """The last steps' records on this stage (timing, measured bubble)."""
        return self.role.records

    @property
    def pipeline_ranks(self) -> List[int]:
        """This pipeline's ranks, in stage order."""
        return self.role.pipeline_ranks

    @property
    def transport(self) -> str:
        """How this pipeline's messages travel: "mpi" or "zmq" (point-to-point), or "horovod" (broadcasts)."""
        return self.role.direct.name if self.role.direct is not None else "horovod"

    @property
    def stage_ranks(self) -> List[int]:
        """The ranks holding this stage (one per replica)."""
        return self.role.stage_ranks

    @property
    def pipeline_set(self) -> Any:
        """The Horovod process set of this pipeline."""
        return self.role.pipeline_set

    @property
    def stage_process_set(self) -> Any:
        """The Horovod process set of this stage's replicas (None with a single replica)."""
        return self.role.stage_process_set

    def timing(self) -> str:
        """One line for this stage: mean step seconds, computing seconds and idle share (the bubble)."""
        return self.role.timing()

    def timing_facts(self) -> TimingFacts:
        """What ``timing_report`` needs from this rank: (replica, ``timing()``, mean busy s, mean step s)."""
        book = self.records
        return self.replica, self.timing(), book.mean_busy(), book.mean_wall()

    def timings(self) -> List[str]:
        """Every rank's ``timing()`` line in rank order, then each replica's pipeline bubble, on every rank.

        A collective: call it on every rank.
        """
        backend = self.role.backend
        if backend is None:
            raise ValueError("timings() needs a stage opened with open_stage (it gathers over the backend)")
        name = f"{self.role.link.prefix}.timings"
        return timing_report(backend.collectives.allgather_object(self.timing_facts(), name=name))

"""What both adapters' process pipelines share before any communication: checks, process sets, message dtypes.

``dualframe.torch.DistributedPipeline`` and ``dualframe.tensorflow.DistributedPipeline`` take the
same arguments and refuse the same bad ones with the same messages (``check_pipeline``); they find
or declare the same Horovod process sets (``resolve_process_sets``, handed the framework's Horovod
module, so this module imports none); their messages carry dtypes by the same codes
(``DTYPE_NAMES``); a silent neighbour raises the same ``PeerLostError``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from dualframe.errors import BalanceError, DualframeError, StrategyError
from dualframe.pipeline.partition import partition_ranges
from dualframe.pipeline.action import Action
from dualframe.pipeline.microbatch import recomputed
from dualframe.pipeline.schedule import rank_schedule, stage_placement, virtual_count
from dualframe.strategy import RankGrid, checkpoint_mode, positive_int, validate_devices

#: dtypes a pipeline message may carry, by code: index in this tuple (both frameworks' spelling).
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")
#: Most dimensions a tensor between stages may have: the step agreement's and a message header's room.
MAX_DIMS = 8


class PeerLostError(DualframeError, TimeoutError):
    """A neighbouring stage stopped answering (it died, hangs or Horovod shut down)."""


def check_pipeline(layers: int, balance: Sequence[int], loss_fn: Any, data_parallel: Optional[int],
                   timeout: float, world: int, virtual_stages: int = 1) -> Tuple[List[range], RankGrid]:
    """Check a process pipeline's arguments against its model and world; return the stage ranges and the grid.

    Args:
        layers: how many layers the model has.
        balance: layers per stage (all ``ranks x virtual_stages`` of them).
        loss_fn: None or a callable.
        data_parallel: None or the replicas expected (must equal world // ranks per pipeline).
        timeout: seconds a stage waits for a neighbour (> 0).
        world: the number of processes.
        virtual_stages: stages each rank holds; the grid's ``stages`` are then ranks per pipeline (replicas
            of such a pipeline: the ranks at one position hold the same stages).

    Raises:
        BalanceError, StrategyError: a rule broken; the message names it and the values.

    Example:
        >>> ranges, grid = check_pipeline(5, [3, 2], None, None, 45.0, world=4)
        >>> ranges, grid.replicas
        ([range(0, 3), range(3, 5)], 2)
    """
    ranges = partition_ranges(balance, layers)
    v = virtual_count(virtual_stages)
    if len(ranges) % v or (v > 1 and len(ranges) < 2 * v):
        raise BalanceError(f"balance must describe ranks x virtual_stages stages, at least 2 ranks (balance: "
                           f"{len(ranges)} stages, virtual_stages: {v}); give {max(2, len(ranges) // v) * v} entries")
    if loss_fn is not None and not callable(loss_fn):
        raise StrategyError(f"loss_fn must be callable, e.g. a mean-squared-error loss (loss_fn: {loss_fn!r})")
    grid = RankGrid.build(world, len(ranges) // v)
    if len(ranges) == 1 and grid.replicas > 1:
        # Replicas of a one-stage pipeline share no 2-rank link set; that is plain data parallelism.
        raise StrategyError(
            f"a one-stage pipeline over several processes is data parallelism (balance: {list(balance)}, "
            f"processes: {world}); use DistributedOptimizer, or split the model into >= 2 stages"
        )
    if data_parallel is not None and positive_int("data_parallel", data_parallel) != grid.replicas:
        raise StrategyError(
            f"data_parallel x stages must equal the number of processes (data_parallel: {data_parallel}, "
            f"stages: {grid.stages}, processes: {world}); launch with -np {data_parallel * grid.stages}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise StrategyError(f"timeout must be a number of seconds > 0 (timeout: {timeout!r})")
    return ranges, grid


@dataclass(frozen=True)
class StageLayout:
    """A process pipeline's checked arguments: stage ranges, rank grid, each rank's actions and device.

    ``placement[j]``: the rank (position in its pipeline) holding stage j; with ``virtual_stages`` v > 1,
    ``ranges`` has ``grid.stages x v`` entries and every action names its stage.

    Example:
        >>> layout = layout_pipeline(5, [3, 2], chunks=2, schedule="GPipe", world=2)
        >>> layout.ranges, layout.schedule, [str(a) for a in layout.actions[1]]
        ([range(0, 3), range(3, 5)], 'gpipe', ['F0', 'F1', 'B1', 'B0'])
    """

    ranges: List[range]
    grid: RankGrid
    actions: List[List[Action]]
    devices: Optional[Tuple[str, ...]]
    chunks: int
    schedule: str
    loss_fn: Any
    timeout: float
    #: Activation checkpointing in each stage: ``"always"``, ``"except_last"`` or ``"never"``.
    checkpoint: str = "never"
    #: The rank position of each stage (virtual stages); empty: stage j on position j.
    placement: Tuple[int, ...] = ()

    @property
    def recomputed(self) -> FrozenSet[int]:
        """The micro-batches whose stage forward is run again in their backward (``microbatch.recomputed``)."""
        return recomputed(self.checkpoint, self.chunks)

    @property
    def virtual_stages(self) -> int:
        """Stages per rank (1: each rank holds stage j = its position)."""
        return len(self.ranges) // self.grid.stages

    def held(self, position: int) -> List[int]:
        """The stages the rank at ``position`` of its pipeline holds, ascending."""
        return [j for j, p in enumerate(self.placement or range(len(self.ranges))) if p == position]


def layout_pipeline(layers: int, balance: Sequence[int], chunks: int, schedule: str = "gpipe", loss_fn: Any = None,
                    devices: Optional[Sequence[str]] = None, data_parallel: Optional[int] = None,
                    timeout: float = 45.0, world: int = 1, checkpoint: str = "never",
                    virtual_stages: int = 1) -> StageLayout:
    """Check every argument of a DistributedPipeline (``check_pipeline``, schedule, chunks, devices, checkpoint).

    No communication.

    ``devices``: one per rank of the pipeline (its stages share it). With virtual stages, ``checkpoint``
    applies to each held stage (both adapters recompute each on its own).

    Example:
        >>> layout = layout_pipeline(8, [2] * 4, chunks=4, schedule="zb-v", world=2, virtual_stages=2)
        >>> layout.placement, layout.held(0), [str(a) for a in layout.actions[0][:4]]
        ((0, 1, 1, 0), [0, 3], ['0F0', '0F1', '0F2', '3F0'])

    Raises:
        BalanceError, ChunksError, DeviceError, ScheduleError, StrategyError: a rule broken.
    """
    v = virtual_count(virtual_stages)
    rank_schedule(schedule, 2, 2 * v, v)  # the schedule's own refusals (virtual_stages it cannot run) come first
    ranges, grid = check_pipeline(layers, balance, loss_fn, data_parallel, timeout, world, v)
    actions = rank_schedule(schedule, grid.stages, chunks, v)
    return StageLayout(ranges, grid, actions, validate_devices(devices, grid.stages), chunks, schedule.lower(),
                       loss_fn, timeout, checkpoint=checkpoint_mode(checkpoint),
                       placement=tuple(stage_placement(schedule, grid.stages, v)))


def dtype_code(name: str) -> int:
    """Code of the dtype called ``name`` (``"float32"`` -> 0); StrategyError for others."""
    if name not in DTYPE_NAMES:
        raise StrategyError(f"pipeline messages must have one of the dtypes {list(DTYPE_NAMES)} (dtype: {name})")
    return DTYPE_NAMES.index(name)


def dynamic_process_sets(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether HOROVOD_DYNAMIC_PROCESS_SETS lets process sets be added after ``init``."""
    return (os.environ if environ is None else environ).get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") not in ("", "0")


def resolve_process_sets(hvd: Any, registry: Any, needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
    """Horovod ProcessSets for the rank groups ``needed`` (plus the global set), starting Horovod if needed.

    Before ``init`` they are declared at start-up; afterwards they must exist already, or be
    addable (HOROVOD_DYNAMIC_PROCESS_SETS=1). Every rank calls this with the same groups in the
    same order, so adding is a matched collective.

    Args:
        hvd: the framework's Horovod module (``horovod.torch`` or ``horovod.tensorflow``).
        registry: ``horovod.common.process_sets``.
        needed: the groups, e.g. ``dualframe.pipeline.layout.pipeline_process_sets(world, stages)``.

    Raises:
        StrategyError: Horovod runs without a needed set and cannot add it.
    """
    if not hvd.is_initialized():
        hvd.init(process_sets=[hvd.ProcessSet(list(ranks)) for ranks in needed])
    table = {tuple(ranks): set_id for set_id, ranks in registry._basics._get_process_set_ids_and_ranks().items()}
    missing = [list(ranks) for ranks in needed if tuple(ranks) not in table]
    if missing and not dynamic_process_sets():
        raise StrategyError(
            f"Horovod was started without the process sets this pipeline needs (missing: {missing}); "
            f"start it with hvd.init(process_sets=dualframe.pipeline_process_sets(hvd.size(), stages)) (a graph split: "
            f"pipeline_process_sets(hvd.size(), stages, graph=True)) "
            f"or run with HOROVOD_DYNAMIC_PROCESS_SETS=1"
        )
    for group in missing:
        table[tuple(group)] = hvd.add_process_set(group).process_set_id
    sets: Dict[Tuple[int, ...], Any] = {}
    for key, set_id in table.items():
        ps = hvd.global_process_set if set_id == 0 else registry._temp_process_set_object(set_id)
        if set_id:
            ps.ranks = list(key)
        sets[key] = ps
    return sets


def pipeline_process_sets(world_size: int, stages: int, graph: bool = False) -> List[List[int]]:
    """The groups of ranks a pipeline of ``stages`` over ``world_size`` ranks communicates in.

    Neighbouring pairs of each pipeline (activations, gradients), each whole pipeline (the step's
    agreement, the loss) and each stage's replicas (gradient averaging). With ``graph``, every pair
    of stages of a pipeline too: a graph split sends a value skipping stages straight to its reader
    (``dualframe.pipeline.graph_walk``), whichever pairs the cut makes. Groups of one rank and the
    whole world (Horovod's global set) are left out, as are repeats. Declare them at start-up:
    ``hvd.init(process_sets=pipeline_process_sets(hvd_size, 2))``.

    Example:
        >>> pipeline_process_sets(4, 2)
        [[0, 1], [2, 3], [0, 2], [1, 3]]
        >>> pipeline_process_sets(3, 3, graph=True)
        [[0, 1], [1, 2], [0, 2]]
    """
    grid = RankGrid.build(world_size, stages)
    candidates: List[List[int]] = []
    for group in grid.pipeline_groups:
        candidates += [[a, b] for a, b in zip(group, group[1:])]
        if graph:
            candidates += [[group[p], group[c]] for c in range(len(group)) for p in range(c - 1)]
    candidates += grid.pipeline_groups + grid.stage_groups
    chosen: List[List[int]] = []
    for ranks in candidates:
        if 1 < len(ranks) < world_size and ranks not in chosen:
            chosen.append(ranks)
    return chosen

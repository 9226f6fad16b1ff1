"""Strategy objects: validated plain descriptions of how to spread training; adapters execute them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

from dualframe.dp.shard import check_shard
from dualframe.errors import DeviceError, StrategyError
from dualframe.pipeline.microbatch import validate_chunks
from dualframe.pipeline.partition import validate_balance
from dualframe.pipeline.schedule import registered

#: Reduction ops, by the names Horovod uses (``hvd.Average`` ...), lower-cased.
REDUCE_OPS = ("average", "sum", "adasum", "min", "max", "product")
#: Gradient compressions shared by both adapters.
COMPRESSIONS = ("none", "fp16")
#: Activation checkpointing modes, as in torchgpipe.
CHECKPOINT_MODES = ("always", "except_last", "never")


def positive_int(name: str, value: object) -> int:
    """``value`` when it is an int >= 1; StrategyError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StrategyError(f"{name} must be an int >= 1 ({name}: {value!r})")
    return value


def _choice(name: str, value: object, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise StrategyError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
    return value.lower()


def validate_devices(devices: Optional[Sequence[str]], groups: int) -> Optional[Tuple[str, ...]]:
    """``devices`` as a tuple of one non-empty name per group (None stays None); DeviceError otherwise."""
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise DeviceError(f"devices must be a list with one device per group (devices: {devices!r})")
    for j, device in enumerate(devices):
        if not isinstance(device, str) or not device.strip():
            raise DeviceError(f"devices must be non-empty strings (devices[{j}]: {device!r})")
    if len(devices) != groups:
        raise DeviceError(
            f"devices must name one device per group (len(devices) = {len(devices)}, "
            f"len(balance) = {groups})"
        )
    return tuple(devices)


@dataclass(frozen=True)
class DataParallel:
    """Every rank holds the whole model; gradients are reduced across ranks after backward.

    ``shard`` keeps 1/N of the optimizer state per rank (``"optimizer"``, ZeRO-1) or also 1/N of
    the gradients (``"gradients"``, ZeRO-2) or also 1/N of the parameters (``"parameters"``, ZeRO-3,
    Keras so far): the adapters' ``distribute`` passes it to ``DistributedOptimizer(shard=...)`` (see
    ``dualframe.dp.shard``); the weights stay those of ``"none"``.

    Example:
        >>> import dualframe
        >>> strategy = dualframe.DataParallel(backward_passes_per_step=2, compression="fp16")
        >>> strategy.op, strategy.shard
        ('average', 'none')
        >>> dualframe.DataParallel(shard="Gradients").shard
        'gradients'
    """

    backward_passes_per_step: int = 1
    op: str = "average"
    compression: str = "none"
    gradient_predivide_factor: float = 1.0
    shard: str = "none"

    def __post_init__(self) -> None:
        positive_int("backward_passes_per_step", self.backward_passes_per_step)
        object.__setattr__(self, "op", _choice("op", self.op, REDUCE_OPS))
        object.__setattr__(self, "compression", _choice("compression", self.compression, COMPRESSIONS))
        # None and "none" alike mean unsharded; the op check is the wrapper's (a reduce-scatter sums or averages).
        object.__setattr__(self, "shard", check_shard(self.shard, self.op) or "none")
        factor = self.gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise StrategyError(f"gradient_predivide_factor must be a number > 0 (gradient_predivide_factor: {factor!r})")
        if factor != 1.0 and self.op != "average":
            raise StrategyError(
                f"gradient_predivide_factor only applies to op='average' (op: {self.op!r}, "
                f"gradient_predivide_factor: {factor})"
            )


@dataclass(frozen=True)
class ModelParallel:
    """The strategy (a plain description): the layers split into consecutive groups, group j on ``devices[j]``.

    Framework-neutral data, validated here; the modules that run it are the adapters' classes of
    the same name, ``dualframe.torch.ModelParallel`` and ``dualframe.tensorflow.ModelParallel``.

    Example:
        >>> import dualframe
        >>> strategy = dualframe.ModelParallel(balance=[2, 2], devices=["cuda:0", "cuda:1"])
        >>> strategy.stages
        2
    """

    balance: Sequence[int]
    devices: Optional[Sequence[str]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "balance", tuple(validate_balance(self.balance)))
        object.__setattr__(self, "devices", validate_devices(self.devices, len(self.balance)))

    @property
    def stages(self) -> int:
        """Number of groups (pipeline stages)."""
        return len(self.balance)


@dataclass(frozen=True)
class Pipeline(ModelParallel):
    """The strategy (a plain description): a model split plus micro-batching, run by a named schedule.

    Each mini-batch is cut into ``chunks`` micro-batches; ``schedule`` is any name in the schedule
    registry (``dualframe.pipeline.schedule``: ``"gpipe"``, ``"1f1b"``). The modules that run it are the
    adapters' classes: ``dualframe.torch.Pipeline`` / ``dualframe.tensorflow.Pipeline`` (one process, its
    devices) and ``DistributedPipeline`` (one stage per process).

    Example:
        >>> import dualframe
        >>> strategy = dualframe.Pipeline(balance=[3, 3], chunks=8, checkpoint="never")
        >>> strategy.schedule
        'gpipe'
    """

    chunks: int = 1
    checkpoint: str = "except_last"
    schedule: str = "gpipe"

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_chunks(self.chunks)
        object.__setattr__(self, "checkpoint", _choice("checkpoint", self.checkpoint, CHECKPOINT_MODES))
        # The names come from the schedule registry (dualframe.pipeline.schedule.register).
        object.__setattr__(self, "schedule", registered(self.schedule).name)


@dataclass(frozen=True)
class Hybrid:
    """Pipeline (or split) stages inside, data parallelism across replicas of the whole pipeline.

    With ``stages_as_processes=False`` every rank holds a whole model split over its own devices and
    ranks are replicas. With ``True`` each rank holds one stage: a world of ``replicas x stages`` ranks,
    rank = replica * stages + stage.

    Example:
        >>> import dualframe
        >>> hybrid = dualframe.Hybrid(dualframe.Pipeline([2, 2], chunks=4), stages_as_processes=True)
        >>> hybrid.grid(world_size=4).stage_groups
        [[0, 2], [1, 3]]
    """

    pipeline: Union[Pipeline, ModelParallel]
    data_parallel: DataParallel = field(default_factory=DataParallel)
    stages_as_processes: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.pipeline, ModelParallel):
            raise StrategyError(
                f"Hybrid needs a dualframe.Pipeline or dualframe.ModelParallel (pipeline: {self.pipeline!r})"
            )
        if not isinstance(self.data_parallel, DataParallel):
            raise StrategyError(f"data_parallel must be a dualframe.DataParallel (data_parallel: {self.data_parallel!r})")

    def grid(self, world_size: int) -> "RankGrid":
        """Lay ``world_size`` ranks out as replicas x stages (see RankGrid)."""
        stages = self.pipeline.stages if self.stages_as_processes else 1
        return RankGrid.build(world_size, stages)


@dataclass(frozen=True)
class RankGrid:
    """Ranks laid out as ``replicas x stages``: rank = replica * stages + stage.

    Example:
        >>> RankGrid.build(4, 2).pipeline_groups
        [[0, 1], [2, 3]]
    """

    replicas: int
    stages: int

    @classmethod
    def build(cls, world_size: int, stages: int) -> "RankGrid":
        """Validate that ``world_size`` is a multiple of ``stages`` and build the grid."""
        positive_int("world size", world_size)
        positive_int("stages", stages)
        if world_size % stages:
            raise StrategyError(
                f"the number of processes must be a multiple of the number of stages "
                f"(processes: {world_size}, stages: {stages}); launch with -np {stages * max(1, world_size // stages)}"
            )
        return cls(world_size // stages, stages)

    def position(self, rank: int) -> Tuple[int, int]:
        """(replica, stage) of ``rank``."""
        return divmod(rank, self.stages)

    @property
    def stage_groups(self) -> List[List[int]]:
        """For each stage, the ranks that hold it: they average that stage's gradients."""
        return [[r * self.stages + j for r in range(self.replicas)] for j in range(self.stages)]

    @property
    def pipeline_groups(self) -> List[List[int]]:
        """For each replica, its ranks in stage order: activations flow along them."""
        return [[r * self.stages + j for j in range(self.stages)] for r in range(self.replicas)]


Strategy = Union[DataParallel, ModelParallel, Pipeline, Hybrid]

"""The advisor: every strategy's per-device memory for one model, and the one to use, with its arguments.

The rule, in order: the whole model fits one device -> data parallelism over every device; it fits
once the optimizer state (then also the gradients) is sharded over the
replicas -> data parallelism with a sharded optimizer (ZeRO-1, then ZeRO-2: the same bytes moved,
no recomputation); it fits once activations shrink -> data parallelism with activation
checkpointing (or gradient accumulation); it fits once the parameters are sharded too -> ZeRO-3
(1.5x the bytes moved, each layer gathered twice; torch and Keras); it does not fit -> the fewest pipeline stages that fit (GPipe, ``chunks >= 4 x
stages`` so the bubble ``(n-1)/(m+n-1)`` stays small), and with devices to spare, replicas of that
pipeline (hybrid). Pipelines come in two rows: ``"pipeline"`` keeps every micro-batch's activations,
``"pipeline + checkpointing"`` (``checkpoint="except_last"``) only each stage's inputs and one
micro-batch's, recomputing a forward per micro-batch; of the two that fit, the one with the fewer
device-seconds per step (``step_cost``) is recommended: the recomputation is paid only where keeping
activations would need more stages than there are devices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from dualframe.dp.zero3 import ZERO3, ZERO3_FRAMEWORKS
from dualframe.pipeline.microbatch import recomputed
from dualframe.pipeline.partition import partition_ranges
from dualframe.pipeline.clock import gpipe_bubble
from dualframe.plan.cuts import balance_of, checkpoint_starts, stage_starts
from dualframe.plan.hardware import Hardware, format_bytes
from dualframe.plan.memory import Memory, Training, best_segments, group_memory
from dualframe.plan.profile import ModelProfile

# Index names: n stages, m micro-batches (chunks), j stage, r replicas.


#: GPipe's idle share of a step, ``bubble(stages, chunks)``: the schedule module's one formula.
bubble = gpipe_bubble


#: A forward's share of a training step's compute (backward about twice a forward): what recomputing costs.
FORWARD_SHARE = 1 / 3

#: The process-pipeline rows: activations kept, or each stage's inputs kept and its forward recomputed.
PIPELINES = ("pipeline", "pipeline + checkpointing")

#: The sharded data-parallel rows and their ``DistributedOptimizer(shard=...)``.
SHARDED = {"data parallel + sharded optimizer": "optimizer", "data parallel + sharded gradients": "gradients",
           "data parallel + sharded parameters": "parameters"}


#: What each sharded row shards, for the recommendation's reason.
SHARDED_WHAT = {"optimizer": "optimizer state", "gradients": "optimizer state and gradients",
                "parameters": "parameters, gradients and optimizer state"}


def pipeline_chunks(stages: int, batch_size: int) -> int:
    """Micro-batches for ``stages``: 4 per stage (m >= 4n keeps the bubble under 20%), at most the batch."""
    return max(1, min(4 * stages, batch_size))


@dataclass(frozen=True)
class Option:
    """One way to train the model and what each of its devices must hold.

    Example:
        >>> option = Option("data parallel", stages=1, replicas=8, chunks=1, balance=(12,),
        ...                 memory=Memory(1e9, 1e9, 2e9, 3e9), fits=True)
        >>> option.devices
        8
    """

    kind: str
    stages: int
    replicas: int
    chunks: int
    balance: Tuple[int, ...]
    memory: Memory
    fits: bool
    checkpoint: str = "never"
    backward_passes_per_step: int = 1
    segments: int = 1
    cuts: Tuple[int, ...] = ()
    split_points: Tuple[str, ...] = ()
    shard: Optional[str] = None

    @property
    def devices(self) -> int:
        """Devices the option uses: stages x replicas."""
        return self.stages * self.replicas

    @property
    def bubble(self) -> float:
        """Pipeline idle share (0 without stages)."""
        return gpipe_bubble(self.stages, self.chunks) if self.stages > 1 else 0.0


@dataclass(frozen=True)
class Plan:
    """Every option the advisor weighed, the recommended one and why.

    Example:
        >>> plan = advise(profile, Training(batch_size=32), Hardware(16 * 2**30))  # doctest: +SKIP
        >>> plan.recommended.kind                                                  # doctest: +SKIP
        'data parallel'
    """

    profile: ModelProfile
    training: Training
    hardware: Hardware
    options: Sequence[Option]
    recommended: Optional[Option]
    reason: str
    alternatives: Sequence[Option] = field(default_factory=tuple)


def _option(kind: str, profile: ModelProfile, training: Training, hardware: Hardware, balance: Sequence[int],
            replicas: int, chunks: int = 1, checkpoint: str = "never", passes: int = 1, segments: int = 1,
            cuts: Sequence[int] = (), shard: Optional[str] = None) -> Option:
    step = Training(math.ceil(training.batch_size / passes), training.optimizer, training.dtype,
                    training.mixed_precision)
    ranges = partition_ranges(balance, profile.num_layers)
    per_device = [group_memory(profile, layers, step, chunks, checkpoint, replicas, segments, cuts, shard)
                  for layers in ranges]
    worst = max(per_device, key=lambda memory: memory.total)
    # A split's stages, or a graph's checkpointed segments, begin at these nodes.
    points = profile.split_points(cuts or [layers.start for layers in ranges])
    return Option(kind, len(balance), replicas, chunks, tuple(balance), worst,
                  worst.total <= hardware.usable_memory, checkpoint, passes, segments, tuple(cuts), tuple(points),
                  shard)


def _checkpointing(profile: ModelProfile, training: Training, hardware: Hardware) -> Option:
    """torch chains: ``checkpoint_sequential``; Keras chains: each layer (RematScope); graphs: chosen segments."""
    everything, replicas = [profile.num_layers], hardware.devices
    kind = "data parallel + checkpointing"
    if profile.is_graph:
        return _option(kind, profile, training, hardware, everything, replicas, checkpoint="segments",
                       cuts=checkpoint_starts(profile, training))
    if profile.framework == "torch":
        return _option(kind, profile, training, hardware, everything, replicas, checkpoint="segments",
                       segments=best_segments(profile, training))
    return _option(kind, profile, training, hardware, everything, replicas, checkpoint="layers")


def _data_parallel(profile: ModelProfile, training: Training, hardware: Hardware) -> List[Option]:
    everything, replicas = [profile.num_layers], hardware.devices
    options = [_option("data parallel", profile, training, hardware, everything, replicas)]
    if replicas > 1:  # sharding needs replicas to share with
        # ZeRO-3 frees each block's weights, so it refuses tied ones (read by several modules).
        zero3 = profile.framework in ZERO3_FRAMEWORKS and not profile.shared
        options += [_option(kind, profile, training, hardware, everything, replicas, shard=shard)
                    for kind, shard in SHARDED.items() if shard != ZERO3 or zero3]
    options.append(_checkpointing(profile, training, hardware))
    # Fewest backward passes per step whose smaller per-pass batch fits.
    passes = [k for k in range(2, training.batch_size + 1) if k == training.batch_size or training.batch_size % k == 0]
    accumulation = None
    for k in passes:
        accumulation = _option("data parallel + accumulation", profile, training, hardware, everything, replicas,
                               passes=k)
        if accumulation.fits:
            break
    return options + ([accumulation] if accumulation else [])


def step_cost(option: Option) -> float:
    """Device-seconds per step relative to one device's forward and backward of the whole batch.

    ``(1 + FORWARD_SHARE x recomputed share) / (1 - bubble)``: each stage idles for the bubble, and a
    checkpointed micro-batch's forward runs twice.

    Example:
        >>> plain = Option("pipeline", 3, 1, 12, (3, 3, 2), Memory(0, 0, 0, 0), True)
        >>> recomputing = Option("pipeline + checkpointing", 2, 1, 8, (4, 4), Memory(0, 0, 0, 0), True,
        ...                      checkpoint="except_last")
        >>> round(step_cost(plain), 3), round(step_cost(recomputing), 3)
        (1.167, 1.453)
    """
    share = len(recomputed(option.checkpoint, option.chunks)) / option.chunks if option.stages > 1 else 0.0
    return (1 + FORWARD_SHARE * share) / (1 - option.bubble)


def _split(profile: ModelProfile, training: Training, hardware: Hardware, kind: str, stages: int,
           replicas: int) -> Option:
    chunks = 1 if kind == "model split" else pipeline_chunks(stages, training.batch_size)
    checkpoint = "never" if kind in ("model split", "pipeline") else "except_last"
    starts = stage_starts(profile, training, stages, chunks, checkpoint, replicas, hardware.usable_memory,
                          slack=1.0 if kind == "model split" else 1.5)
    return _option(kind, profile, training, hardware, balance_of(starts, profile.num_layers), replicas, chunks,
                   checkpoint)


def _fewest_stages(profile: ModelProfile, training: Training, hardware: Hardware, kind: str,
                   most: int) -> Optional[Option]:
    """The option with the fewest stages (2..most) that fits, else the one with the most stages.

    A hybrid runs ``devices // stages`` replicas and needs at least two of them.
    """
    option = None
    for n in range(2, min(most, profile.num_layers) + 1):
        replicas = hardware.devices // n if kind == "hybrid" else 1
        if kind == "hybrid" and replicas < 2:
            break
        option = _split(profile, training, hardware, kind, n, replicas)
        if option.fits:
            break
    return option


def options(profile: ModelProfile, training: Training, hardware: Hardware) -> List[Option]:
    """Every option: data parallel (plain, checkpointing, accumulation), split, pipeline, hybrid."""
    found = _data_parallel(profile, training, hardware)
    found += [option for option in (
        _fewest_stages(profile, training, hardware, "model split", hardware.devices_per_node),
        _fewest_stages(profile, training, hardware, "pipeline", hardware.devices),
        _fewest_stages(profile, training, hardware, "pipeline + checkpointing", hardware.devices),
        _fewest_stages(profile, training, hardware, "hybrid", hardware.devices // 2),
    ) if option is not None]
    return found


def advise(profile: ModelProfile, training: Training, hardware: Hardware) -> Plan:
    """Weigh every option and recommend one (see the module docstring for the rule)."""
    found = options(profile, training, hardware)
    by_kind = {option.kind: option for option in found}
    usable = hardware.usable_memory
    plain = by_kind["data parallel"]
    if plain.fits:
        return Plan(profile, training, hardware, found, plain, "the whole model and its batch fit one device")
    # ZeRO-3 last: it gathers every layer twice per step (1.5x the bytes of plain DP, a wait per layer).
    zero1_2 = [k for k, shard in SHARDED.items() if shard != ZERO3]
    order = (*zero1_2, "data parallel + checkpointing", "data parallel + accumulation", "data parallel + sharded parameters")
    fitting_dp = [by_kind[k] for k in order if k in by_kind and by_kind[k].fits]
    if fitting_dp:
        what = (f"sharding the {SHARDED_WHAT.get(str(fitting_dp[0].shard))}"
                f" over the {plain.replicas} replicas brings a device to {_gib(fitting_dp[0].memory.total)}"
                if fitting_dp[0].shard else "activations must shrink")
        return Plan(profile, training, hardware, found, fitting_dp[0],
                    f"the model nearly fits: {what} ({_gib(plain.memory.total)} needed, "
                    f"{_gib(usable)} usable per device)", tuple(fitting_dp[1:]))
    pipelines = sorted((by_kind[k] for k in PIPELINES if k in by_kind and by_kind[k].fits), key=step_cost)
    fitting = [by_kind[k] for k in ("hybrid",) if k in by_kind and by_kind[k].fits] + pipelines
    staged = fitting[0] if fitting else by_kind.get("pipeline + checkpointing")
    if staged is not None and staged.fits:
        spare = "; spare devices hold replicas" if staged.kind == "hybrid" else ""
        recompute = (", each stage recomputing its micro-batches' forward (no more stages than devices otherwise)"
                     if staged.kind == "pipeline + checkpointing" else "")
        return Plan(profile, training, hardware, found, staged,
                    f"the model does not fit one device ({_gib(plain.memory.total)} needed, {_gib(usable)} usable): "
                    f"{staged.stages} pipeline stages fit{spare}{recompute}", tuple(pipelines[1:]))
    return Plan(profile, training, hardware, found, None,
                f"nothing fits: even over {staged.stages if staged else 1} stage(s) a device needs "
                f"{_gib((staged or plain).memory.total)} ({_gib(usable)} usable); add devices, use mixed "
                f"precision, a smaller batch or a lighter optimizer")


def _gib(value: float) -> str:
    return format_bytes(value)

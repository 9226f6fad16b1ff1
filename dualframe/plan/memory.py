"""Memory arithmetic: bytes one device needs to train a group of layers, for every strategy's shape.

Per device: parameters, gradients, optimizer state (SGD 0, momentum 1x, Adam 2x the parameters),
saved activations (the whole batch, or stage boundaries plus one recomputed micro-batch when
checkpointing), and buffers (gradients flowing back, half-precision weight copies under mixed
precision, Horovod's fusion buffer when there are replicas). With a sharded optimizer over N
replicas (``dualframe.dp.shard``) the optimizer state is 1/N, and with sharded gradients the
gradients too; the flat buckets in flight join the buffers. With sharded parameters (ZeRO-3,
``dualframe.dp.zero3``) the trainable parameters are 1/N as well, and ``ZERO3_GATHERED`` copies of
the largest layer's parameters join the buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dualframe.dp.shard import BUCKET_ELEMENTS, check_shard
from dualframe.errors import StrategyError
from dualframe.plan.profile import ModelProfile, dtype_bytes

#: Optimizer state per trainable parameter, in parameter-sized slots.
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
#: Horovod's default tensor-fusion buffer (HOROVOD_FUSION_THRESHOLD), allocated once per process.
FUSION_BUFFER_BYTES = 64 * 1024 * 1024
#: ZeRO-3's full copies of a layer, at most, beside the slices: the running layer's, the next one's
#: arriving (prefetched), and one layer's flat gradient being reduced.
ZERO3_GATHERED = 3
#: How activations are kept for backward: all of them; every layer's input (each layer recomputed
#: alone, as Keras' ``RematScope(mode="full")``, for chains); ``segments``: runs of layers, equal
#: (torch's ``checkpoint_sequential``) or beginning at chosen cuts (graphs), the last run kept, the
#: others keeping only the values live across their starts; per stage and micro-batch as GPipe does
#: (``"always"``/``"except_last"`` in dualframe.Pipeline).
CHECKPOINTS = ("never", "layers", "segments", "always", "except_last")


@dataclass(frozen=True)
class Training:
    """What a training step looks like: batch per replica, optimizer, precision.

    Example:
        >>> Training(batch_size=64, optimizer="adam", mixed_precision=True).activation_bytes
        2

    Attributes:
        batch_size: rows per replica per step (what each data-parallel rank feeds).
        optimizer: ``sgd``, ``momentum``, ``adam`` or ``adamw``.
        dtype: the parameters' dtype; gradients and optimizer state share it.
        mixed_precision: compute in float16/bfloat16 with ``dtype`` master weights (torch
            ``autocast``, Keras ``mixed_float16``): activations take 2 bytes.
    """

    batch_size: int
    optimizer: str = "adam"
    dtype: str = "float32"
    mixed_precision: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise StrategyError(f"batch_size must be an int >= 1 (batch_size: {self.batch_size!r})")
        if self.optimizer not in OPTIMIZER_SLOTS:
            raise StrategyError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZER_SLOTS)}")
        dtype_bytes(self.dtype)

    @property
    def parameter_bytes(self) -> int:
        """Bytes per parameter, gradient and optimizer slot element."""
        return dtype_bytes(self.dtype)

    @property
    def activation_bytes(self) -> int:
        """Bytes per saved activation element."""
        return 2 if self.mixed_precision else self.parameter_bytes


@dataclass(frozen=True)
class Memory:
    """Bytes on one device, by what holds them.

    Example:
        >>> Memory(parameters=4e6, gradients=4e6, optimizer=8e6, activations=1e6).total
        17000000.0
    """

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float = 0.0

    @property
    def total(self) -> float:
        """All of it."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers


def shard_divisors(shard: Optional[str], replicas: int) -> Tuple[float, int]:
    """How many times smaller a rank's (gradients, optimizer state) are with ``shard`` over ``replicas``.

    ZeRO-1 (``"optimizer"``) keeps the full gradients plus the reduced gradient of the rank's slice
    (1 + 1/N of them) and 1/N of the state; ZeRO-2 (``"gradients"``) and ZeRO-3 (``"parameters"``)
    keep 1/N of both.

    Example:
        >>> shard_divisors(None, 4), shard_divisors("optimizer", 4), shard_divisors("parameters", 4)
        ((1.0, 1), (0.8, 4), (4.0, 4))
    """
    mode = check_shard(shard)
    if mode is None:
        return 1.0, 1
    if mode == "optimizer":
        return replicas / (replicas + 1.0), replicas
    return float(replicas), replicas


def sharded_bytes(trainable_bytes: float, slots: int, shard: Optional[str], replicas: int) -> Tuple[float, float, float]:
    """A rank's (parameter, gradient, optimizer-state) bytes of ``trainable_bytes`` of parameters, sharded ``shard``.

    ``slots`` is the optimizer's state per parameter in parameter sizes (``OPTIMIZER_SLOTS``).

    Example:
        >>> sharded_bytes(400.0, 2, None, 4), sharded_bytes(400.0, 2, "parameters", 4)
        ((400.0, 400.0, 800.0), (100.0, 100.0, 200.0))
    """
    gradients_divisor, optimizer_divisor = shard_divisors(shard, replicas)
    parameters = trainable_bytes / replicas if check_shard(shard) == "parameters" else trainable_bytes
    return parameters, trainable_bytes / gradients_divisor, trainable_bytes * slots / optimizer_divisor


def sequential_segments(layers: int, segments: int) -> List[range]:
    """The runs ``torch.utils.checkpoint.checkpoint_sequential`` makes: equal runs, the rest in the last.

    Example:
        >>> sequential_segments(7, 3)
        [range(0, 2), range(2, 4), range(4, 7)]
    """
    size = layers // segments
    return [range(k * size, (k + 1) * size) for k in range(segments - 1)] + [range((segments - 1) * size, layers)]


def segment_runs(starts: Sequence[int], stop: int) -> List[range]:
    """The runs of nodes that segments beginning at ``starts`` make, up to ``stop``.

    Example:
        >>> segment_runs([0, 3, 5], 8)
        [range(0, 3), range(3, 5), range(5, 8)]
    """
    return [range(a, b) for a, b in zip(starts, list(starts[1:]) + [stop])]


def kept_at(profile: ModelProfile, cuts: Sequence[int]) -> float:
    """Per-sample elements of every value live across any of ``cuts``, each value counted once."""
    return sum(value.elements for value in profile.flow() if any(value.live_across(c) for c in cuts))


def _activations(profile: ModelProfile, layers: range, batch: int, micro_batch: int, checkpoint: str,
                 segments: int, cuts: Sequence[int] = ()) -> float:
    """Saved activation elements of ``layers`` at the peak of the step (before the dtype's bytes)."""
    saved = [profile.layers[j].activations for j in layers]
    if checkpoint == "never":
        return sum(saved) * batch
    if checkpoint == "layers":
        inputs = profile.layer_inputs()
        return sum(inputs[j] for j in layers) * batch + max(saved) * batch
    if checkpoint == "segments":
        starts = list(cuts) or [layers.start + run.start for run in sequential_segments(len(saved), segments)]
        runs = segment_runs(starts, layers.stop)
        kept = [sum(profile.layers[j].activations for j in run) for run in runs]
        # Checkpointed runs keep the values live across their starts; the last run keeps everything
        # until its backward is done; then one run at a time is recomputed.
        return (kept_at(profile, starts[:-1]) + max(kept)) * batch
    # GPipe: each micro-batch keeps only what enters the stage; one micro-batch is recomputed at a time.
    return profile.live()[layers.start] * batch + sum(saved) * micro_batch


def best_segments(profile: ModelProfile, training: Training) -> int:
    """The ``checkpoint_sequential`` segment count that keeps the fewest activations."""
    whole = range(profile.num_layers)
    return min(range(1, profile.num_layers + 1), key=lambda s: _activations(
        profile, whole, training.batch_size, training.batch_size, "segments", s))


def group_memory(profile: ModelProfile, layers: range, training: Training, chunks: int = 1,
                 checkpoint: str = "never", replicas: int = 1, segments: int = 1,
                 cuts: Sequence[int] = (), shard: Optional[str] = None) -> Memory:
    """Memory of the device holding ``layers`` of ``profile``.

    Args:
        profile: the measured model.
        layers: indices of the layers on this device (a range from ``partition_ranges``).
        training: batch, optimizer and precision.
        chunks: micro-batches per mini-batch (1 without a pipeline).
        checkpoint: one of CHECKPOINTS.
        replicas: data-parallel copies of these layers; above one, Horovod's fusion buffer counts.
        segments: equal runs of layers for ``checkpoint="segments"`` (``checkpoint_sequential``).
        cuts: for ``checkpoint="segments"`` on a graph: the nodes where segments begin (the first
            is ``layers.start``); overrides ``segments``.
        shard: None, ``"optimizer"``, ``"gradients"`` or ``"parameters"``: data-parallel sharding over ``replicas``.

    Returns:
        The Memory breakdown.
    """
    if checkpoint not in CHECKPOINTS:
        raise StrategyError(f"unknown checkpoint {checkpoint!r}; choose one of {', '.join(CHECKPOINTS)}")
    group = [profile.layers[j] for j in layers]
    trainable = sum(layer.parameters for layer in group) + profile.copies(layers.start, layers.stop)
    frozen = sum(layer.frozen for layer in group)
    size = training.parameter_bytes
    micro_batch = math.ceil(training.batch_size / chunks)
    activations = _activations(profile, layers, training.batch_size, micro_batch, checkpoint, segments, cuts)
    # Backward holds the gradient of the largest tensor and of its input at once.
    flowing = 2 * max(layer.largest for layer in group) * micro_batch * training.activation_bytes
    half_weights = trainable * 2 if training.mixed_precision else 0
    fusion = min(FUSION_BUFFER_BYTES, trainable * size) if replicas > 1 else 0
    parameters, gradients, state = sharded_bytes(trainable * size, OPTIMIZER_SLOTS[training.optimizer], shard,
                                                 replicas)
    # Sharding: a bucket's flat gradient in flight and the window of gathered buckets (two in all);
    # ZeRO-3: the gathered layers (the largest, ZERO3_GATHERED times).
    buckets = 2 * min(trainable, BUCKET_ELEMENTS) * size if shard is not None else 0
    if check_shard(shard) == "parameters":
        buckets = ZERO3_GATHERED * max(layer.parameters for layer in group) * size
    return Memory(
        parameters=parameters + frozen * size,
        gradients=gradients,
        optimizer=state,
        activations=activations * training.activation_bytes,
        buffers=flowing + half_weights + fusion + buckets,
    )

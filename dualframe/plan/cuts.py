"""Where to cut a model: pipeline stages and checkpointed segments, chosen over its nodes' real costs.

A stage's memory is not a sum of per-node costs: it keeps the values live across the cut where it
begins (skip tensors, masks, not just the previous node's output), so stages are chosen by exact
stage costs (``group_memory`` arithmetic with prefix sums) rather than by ``balance_by_cost``.
Any node may begin a stage or a segment: the probes make nodes only where one may (a Keras layer,
a torch submodule in execution order), and name each with its split point.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

from dualframe.errors import StrategyError
from dualframe.plan.memory import FUSION_BUFFER_BYTES, OPTIMIZER_SLOTS, Training, group_memory, segment_runs
from dualframe.plan.profile import ModelProfile

# Index names: a, b node indices (a stage holds nodes a..b-1), n stages, k a stage count so far.


class StageCosts:
    """Bytes one device needs for nodes ``a..b-1``, for any ``a < b``, in O(1) after O(N^2) set-up.

    Equal to ``group_memory(profile, range(a, b), ...).total``, without its per-call sums.

    Example:
        >>> from dualframe.plan import LayerProfile
        >>> model = ModelProfile("torch", "chain", (4,), [LayerProfile(f"l{j}", 100, 0, 10.0, 4.0, 4.0)
        ...                                               for j in range(4)], 4.0)
        >>> costs = StageCosts(model, Training(8, "sgd"), chunks=4, checkpoint="except_last")
        >>> costs.total(1, 3) == group_memory(model, range(1, 3), Training(8, "sgd"), 4, "except_last").total
        True
    """

    def __init__(self, profile: ModelProfile, training: Training, chunks: int = 1, checkpoint: str = "never",
                 replicas: int = 1) -> None:
        if checkpoint not in ("never", "always", "except_last"):
            raise StrategyError(f"stage costs are for splits and pipelines: checkpoint must be never, always or "
                                f"except_last (checkpoint: {checkpoint!r})")
        self.count = profile.num_layers
        self.profile = profile
        self.micro_batch = math.ceil(training.batch_size / chunks)
        self.batch, self.checkpoint, self.replicas, self.training = training.batch_size, checkpoint, replicas, training
        self.trainable, self.frozen, self.saved = [0], [0], [0.0]
        for layer in profile.layers:
            self.trainable.append(self.trainable[-1] + layer.parameters)
            self.frozen.append(self.frozen[-1] + layer.frozen)
            self.saved.append(self.saved[-1] + layer.activations)
        self.live = profile.live()
        largest = [layer.largest for layer in profile.layers]
        self.largest = [[0.0] * (self.count + 1) for _ in range(self.count)]
        for a in range(self.count):
            running = 0.0
            for b in range(a + 1, self.count + 1):
                running = max(running, largest[b - 1])
                self.largest[a][b] = running

    def parameters(self, a: int, b: int) -> int:
        """Trainable parameters of nodes a..b-1, with the copies of shared parameters they read."""
        return self.trainable[b] - self.trainable[a] + self.profile.copies(a, b)

    def total(self, a: int, b: int) -> float:
        """Bytes of the device holding nodes a..b-1 (see ``group_memory``); 0 for no nodes."""
        if b <= a:
            return 0.0
        t, size = self.training, self.training.parameter_bytes
        trainable = self.parameters(a, b)
        saved = self.saved[b] - self.saved[a]
        if self.checkpoint == "never":
            activations = saved * self.batch
        else:
            activations = self.live[a] * self.batch + saved * self.micro_batch
        buffers = 2 * self.largest[a][b] * self.micro_batch * t.activation_bytes
        buffers += trainable * 2 if t.mixed_precision else 0
        buffers += min(FUSION_BUFFER_BYTES, trainable * size) if self.replicas > 1 else 0
        state = (trainable + self.frozen[b] - self.frozen[a]) * size
        state += trainable * size * (1 + OPTIMIZER_SLOTS[t.optimizer])
        return state + activations * t.activation_bytes + buffers


def _minimax(count: int, stages: int, cost: Callable[[int, int], Any],
             allowed: Optional[Callable[[int, int], bool]] = None) -> Tuple[Any, List[int]]:
    """Contiguous groups of ``count`` nodes into ``stages`` minimising the largest ``cost(a, b)``.

    Costs may be tuples (compared in order: ties on the first are broken by the next). ``allowed(a,
    b)`` (optional) rules groups out. Returns (the largest cost, the starts), or (None, []) when no
    split is allowed.
    """
    best: List[List[Any]] = [[None] * (count + 1) for _ in range(stages + 1)]
    back = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = cost(0, 0)
    for k in range(1, stages + 1):
        for b in range(k, count - (stages - k) + 1):
            for a in range(k - 1, b):
                if best[k - 1][a] is None or (allowed is not None and not allowed(a, b)):
                    continue
                worst = max(best[k - 1][a], cost(a, b))
                if best[k][b] is None or worst < best[k][b]:
                    best[k][b], back[k][b] = worst, a
    if best[stages][count] is None:
        return None, []
    starts, b = [], count
    for k in range(stages, 0, -1):
        b = back[k][b]
        starts.append(b)
    return best[stages][count], starts[::-1]


def stage_starts(profile: ModelProfile, training: Training, stages: int, chunks: int = 1,
                 checkpoint: str = "never", replicas: int = 1, usable: float = math.inf,
                 slack: float = 1.5) -> List[int]:
    """The nodes where ``stages`` stages begin: the least memory on the fullest device, then even parameters.

    First the split whose fullest device needs the least memory; then, among splits whose every
    device stays within what fits (``usable``, at most ``slack`` x that least memory), the one
    whose largest stage holds the fewest parameters. In a pipeline the stages run at once and the
    slowest sets the pace: memory alone would put ResNet-50's early, activation-heavy layers on
    one stage and 97% of its weights (its late, weight-heavy layers) on the other. A model split
    runs one stage at a time, so ``slack=1`` (memory only, parameters break ties) suits it.

    Returns:
        The start of each stage (the first is 0), as many as ``stages``.

    Example:
        >>> from dualframe.plan import LayerProfile
        >>> nine = ModelProfile("torch", "chain", (4,), [LayerProfile(f"l{j}", 100, 0, 100.0, 4.0, 4.0)
        ...                                              for j in range(9)], 4.0)
        >>> stage_starts(nine, Training(8, "sgd"), stages=3)
        [0, 3, 6]
    """
    costs = StageCosts(profile, training, chunks, checkpoint, replicas)
    least, starts = _minimax(costs.count, stages, costs.total)
    bound = max(least, min(usable, slack * least))
    _, even = _minimax(costs.count, stages, lambda a, b: (costs.parameters(a, b), costs.total(a, b)),
                       lambda a, b: costs.total(a, b) <= bound)
    return even or starts


def balance_of(starts: Sequence[int], count: int) -> List[int]:
    """Nodes per stage for stages beginning at ``starts``: ``[0, 3, 5]`` of 8 -> ``[3, 2, 3]``."""
    return [len(run) for run in segment_runs(starts, count)]


def checkpoint_starts(profile: ModelProfile, training: Training) -> List[int]:
    """Where checkpointed segments should begin (first 0) for the fewest activations at the peak.

    For each budget ``M`` (the most activations one segment may save), the segments whose starts
    keep the fewest live values; the best budget wins. One segment (no checkpointing) is a
    candidate too, so the result is never worse than keeping everything.

    Example:
        >>> from dualframe.plan import LayerProfile
        >>> small_outputs = ModelProfile("torch", "chain", (4,), [LayerProfile(f"l{j}", 100, 0, 100.0, 4.0, 4.0)
        ...                                                       for j in range(4)], 4.0)
        >>> checkpoint_starts(small_outputs, Training(8, "sgd"))    # each node its own segment
        [0, 1, 2, 3]
    """
    count = profile.num_layers
    saved = [0.0]
    for layer in profile.layers:
        saved.append(saved[-1] + layer.activations)
    live = profile.live()
    largest = max(layer.activations for layer in profile.layers)
    budgets = sorted({largest * (saved[-1] / max(largest, 1e-9)) ** (step / 24) for step in range(25)})
    found: List[List[int]] = [[0]]
    for budget in budgets:
        kept, back = [0.0] + [math.inf] * count, [0] * (count + 1)
        for b in range(1, count + 1):
            for a in range(b - 1, -1, -1):
                if saved[b] - saved[a] > budget * (1 + 1e-9):
                    break
                if kept[a] + live[a] < kept[b]:
                    kept[b], back[b] = kept[a] + live[a], a
        if kept[count] < math.inf:
            starts, b = [], count
            while b > 0:
                b = back[b]
                starts.append(b)
            found.append(starts[::-1])
    whole = range(count)
    return min(found, key=lambda starts: (group_memory(profile, whole, training, checkpoint="segments",
                                                       cuts=starts).activations, len(starts)))

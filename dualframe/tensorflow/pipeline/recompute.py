"""Activation checkpointing in a Keras process pipeline's stage: the state a replayed forward must find."""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, FrozenSet, Iterator, List, Sequence

import tensorflow as tf


class StageRecompute:
    """Which micro-batches a stage recomputes, and its non-trainable variables as each one's forward found them.

    A checkpointed micro-batch's forward runs without a tape, keeping only its input; its backward runs
    the forward again under a tape first. ``forward(i)``, called just before the first forward, notes
    the stage's non-trainable variables (Dropout's seed generator state, BatchNormalization's moving
    statistics); ``replaying(i)`` sets them back for the replay and afterwards restores what they had
    become, so a replay draws the same Dropout masks and moving statistics are updated once.

    Example:
        >>> recompute = StageRecompute(layers, frozenset({0}))                  # doctest: +SKIP
        >>> recompute.forward(0); y = run(x)                    # no tape          # doctest: +SKIP
        >>> with recompute.replaying(0), tf.GradientTape() as tape: y = run(x)  # doctest: +SKIP
    """

    def __init__(self, layers: Sequence[Any], micro_batches: FrozenSet[int]) -> None:
        self.micro_batches = micro_batches
        self.variables = [v for layer in layers for v in layer.non_trainable_variables]  # seed states too
        self._states: Dict[int, List[tf.Tensor]] = {}

    def __contains__(self, i: int) -> bool:
        return i in self.micro_batches

    def _values(self) -> List[tf.Tensor]:
        return [tf.identity(v.value) for v in self.variables]

    def forward(self, i: int) -> None:
        """Note the state micro-batch i's first forward starts from."""
        self._states[i] = self._values()

    def replaying(self, i: int) -> ContextManager[None]:
        """Inside: the variables as micro-batch i's first forward found them; after: as before the block."""
        return swapped(self.variables, self._states.pop(i))


@contextlib.contextmanager
def swapped(variables: Sequence[Any], values: Sequence[tf.Tensor]) -> Iterator[None]:
    """Inside: ``variables`` hold ``values``; after: what they held before the block (a replayed forward's state).

    Example:
        >>> with swapped(dropout_seeds, first_forward_seeds): outputs = stage(x)   # doctest: +SKIP
    """
    now = [tf.identity(v.value) for v in variables]
    for variable, value in zip(variables, values):
        variable.assign(value)
    try:
        yield
    finally:
        for variable, value in zip(variables, now):
            variable.assign(value)

"""Activation checkpointing in a torch process pipeline's stage: a forward without a graph, replayed in backward."""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet, List, Optional, Tuple, TypeVar

import torch
from torch import nn

T = TypeVar("T")


class StageRecompute:
    """Runs a stage's forward of a checkpointed micro-batch without keeping its activations, and replays it.

    ``forward(i, run)`` calls ``run`` under ``torch.no_grad()`` after noting the random number
    generators' state (CPU, and the stage's CUDA device); ``replay(i, run)`` calls it again with
    gradients, from that state (the same Dropout masks) inside ``torch.random.fork_rng``, so the
    generators afterwards stand where the first forward left them, and puts back the buffers the
    replay changed (BatchNorm's running statistics are updated once per micro-batch, as without
    checkpointing). Between the two the stage keeps only its inputs, which the caller holds.

    Example:
        >>> recompute = StageRecompute(stage, frozenset({0, 1}), torch.device("cpu"))  # doctest: +SKIP
        >>> y = recompute.forward(0, lambda: stage(x))     # no graph kept                   # doctest: +SKIP
        >>> y = recompute.replay(0, lambda: stage(x))      # in backward: the graph, then backward  # doctest: +SKIP
    """

    def __init__(self, stage: nn.Module, micro_batches: FrozenSet[int], device: torch.device) -> None:
        self.stage, self.micro_batches = stage, micro_batches
        self._cuda = [device] if device.type == "cuda" else []
        self._states: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}

    def __contains__(self, i: int) -> bool:
        return i in self.micro_batches

    def forward(self, i: int, run: Callable[[], T]) -> T:
        """Micro-batch i's forward without a graph (its random state kept for ``replay``)."""
        cuda = torch.cuda.get_rng_state(self._cuda[0]) if self._cuda else None
        self._states[i] = (torch.get_rng_state(), cuda)
        with torch.no_grad():
            return run()

    def replay(self, i: int, run: Callable[[], T]) -> T:
        """Micro-batch i's forward again, with its graph, as the first one ran."""
        cpu, cuda = self._states.pop(i)
        buffers: List[torch.Tensor] = list(self.stage.buffers())
        before = [b.detach().clone() for b in buffers]
        with torch.random.fork_rng(devices=self._cuda):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self._cuda[0])
            with torch.enable_grad():
                out = run()
        with torch.no_grad():
            for buffer, value in zip(buffers, before):
                if not torch.equal(buffer, value):  # unchanged ones untouched: a graph may hold them
                    buffer.copy_(value)
        return out

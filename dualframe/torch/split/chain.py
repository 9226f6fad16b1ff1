"""An ``nn.Sequential``'s layer groups on their devices, run as a graph whose edges are (j - 1, j).

The groups are the split model's ``partitions`` (its ``state_dict`` keys ``partitions.<j>.<k>...``); each
runs as a ``graph.chain.ChainStage`` over the core's ``chain_split``, through the same step as a captured
model (``graph.run.StepRun``). Layers of groups on different devices may not share a tensor
(``check_shared_layers``), so a chain holds no device copies.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Sequence

import torch
from torch import nn

from dualframe.torch.graph.chain import ChainPart, ChainStage
from dualframe.torch.graph.devices import place_stage
from dualframe.torch.graph.run import StepRun
from dualframe.torch.split.devices import DeviceCopies
from dualframe.torch.split.graph import ModeStages


class ChainStages:
    """``partitions[j]`` placed on ``devices[j]``, run as stage j of a chain graph.

    Example:
        >>> groups = [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 2))]
        >>> chain = ChainStages(groups, [torch.device("cpu")] * 2)
        >>> chain.view(True).split.reads
        (('x0',), ('x1',))
    """

    def __init__(self, partitions: Iterable[nn.Module], devices: Sequence[torch.device]) -> None:
        self.partitions, self.devices = list(partitions), list(devices)
        for partition, device in zip(self.partitions, self.devices):
            place_stage(partition, device)
        self.chain = ChainPart(len(self.partitions))
        # Wrappers only: the partitions stay the registered modules (DeferredBatchNorm converts inside them).
        self.modules = [ChainStage(partition) for partition in self.partitions]
        self.copies = DeviceCopies(self.devices, {})

    def view(self, training: bool) -> ModeStages:
        """The stages (the same in both modes); parameters read afresh, as a layer may have been replaced."""
        return ModeStages(self.chain, self.chain.split, list(self.modules),
                          [list(partition.parameters()) for partition in self.partitions], None)

    def run(self, view: ModeStages, plan: Any, parts: Sequence[Dict[str, Any]], **walk: Any) -> StepRun:
        """A step of ``view`` (from ``view()``) over ``parts`` (micro-batches of the input, as ``{"x0": tensor}``)."""
        return StepRun(view.modules, self.devices, plan, view.split, parts, view.params, **walk)

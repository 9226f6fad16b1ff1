"""A chain of layer groups (an ``nn.Sequential`` cut by ``balance``) as a graph split whose edges are (j - 1, j).

Stage j reads ``"x<j>"`` and sends ``"x<j+1>"`` (the core's ``chain_split``), so a chain runs through the same
step as a captured model: the one-process ``ModelParallel`` / ``Pipeline`` (``graph.run.StepRun``) and the
process ``DistributedPipeline`` (``pipeline.graph_work``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch

from dualframe.pipeline.graph import GraphSplit, chain_split


def chain_layers(module: torch.nn.Module, indices: Iterable[int]) -> torch.nn.Sequential:
    """The layers at ``indices`` of an ``nn.Sequential``, under the model's names (a stage's, or a rank's stages').

    Example:
        >>> chain_layers(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh(), torch.nn.ReLU()), [1, 2])
        Sequential(
          (1): Tanh()
          (2): ReLU()
        )
    """
    items = list(module._modules.items())
    return torch.nn.Sequential(OrderedDict(items[r] for r in indices))  # type: ignore[arg-type,misc]


class ChainStage(torch.nn.Module):
    """A chain's stage module as a graph stage: its one input in, the tuple of its one output out.

    Example:
        >>> stage = ChainStage(torch.nn.Sequential(torch.nn.Linear(2, 3)))
        >>> [tuple(t.shape) for t in stage(torch.ones(4, 2))]
        [(4, 3)]
    """

    def __init__(self, layers: torch.nn.Module) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: Any) -> Tuple[Any]:
        return (self.layers(x),)

    # Straight to forward, past nn.Module's call dispatch (a few us a cell): nothing hooks this
    # wrapper, which owns no parameter; the layers inside are called as modules, with their hooks.
    __call__ = forward


class ChainPart:
    """An ``nn.Sequential`` cut into ``stages`` stages as a graph split whose edges are (j - 1, j).

    Example:
        >>> part = ChainPart(2)
        >>> part.split.reads, part.split.sends
        ((('x0',), ('x1',)), (('x1',), ('x2',)))
        >>> part.bind((torch.ones(3, 2),), {})["x0"].shape
        torch.Size([3, 2])
    """

    def __init__(self, stages: int) -> None:
        self.split: GraphSplit = chain_split(stages)
        self.input, self.output = self.split.graph.inputs[0], self.split.graph.outputs[0]

    def bind(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The call's one tensor as the graph's input value.

        Raises:
            TypeError: anything but one positional tensor.
        """
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            got = [type(a).__name__ for a in args] + [f"{k}={type(v).__name__}" for k, v in kwargs.items()]
            raise TypeError(f"the input must be one tensor (got {', '.join(got)})")
        return {self.input: args[0]}

    def unflatten(self, outputs: Dict[str, Any]) -> Any:
        """The model's return value from its output values (the last stage's output)."""
        return outputs[self.output]

    def micro_inputs(self, parts: Sequence[Any]) -> List[Dict[str, Any]]:
        """Each micro-batch of the input as the graph's input values."""
        return [{self.input: part} for part in parts]

    def joined_outputs(self, outputs: Sequence[Dict[str, Any]]) -> Any:
        """The model's output from each micro-batch's output values (on the last stage)."""
        return torch.cat([o[self.output] for o in outputs])

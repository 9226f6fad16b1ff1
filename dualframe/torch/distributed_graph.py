"""The graph side of a torch ``DistributedPipeline``: one cut on every rank, this rank's stage, its inputs, outputs.

Every rank captures the model and cuts it alike (the cut must not depend on timing, which differs
between ranks: ``stages=n`` evens out parameter bytes here; measure once with ``ModelParallel(...,
stages=n, sample=...)`` and pass its ``split_points`` for a cut by time), then keeps one stage's
GraphModule, whose ``state_dict`` keys are the full model's.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from dualframe.errors import StrategyError
from dualframe.pipeline.graph import GraphSplit, cut_graph
from dualframe.torch.graph import Captured, Leaves, capture, capture_other_mode, stage_module
from dualframe.torch.graph_run import _joined, batch_size, split_inputs
from dualframe.torch.graph_split import _param_bytes, sample_call


class GraphPart:
    """The model captured and cut on this rank; ``module(j)`` builds stage j (sharing the model's parameters).

    Example:
        >>> part = GraphPart(model, split_points=["blocks.2"])             # doctest: +SKIP
        >>> part.split.stages, part.module(1)                               # doctest: +SKIP
    """

    def __init__(self, module: torch.nn.Module, *, split_points: Optional[Sequence[str]] = None,
                 balance: Optional[Sequence[int]] = None, stages: Optional[int] = None, sample: Any = None,
                 leaves: Leaves = ()) -> None:
        args = sample_call(sample)[0] if sample is not None else None
        self.captured: Captured = capture(module, leaves=leaves, sample=args)
        costs = [1.0 + c for c in _param_bytes(self.captured)] if stages is not None else None
        self.split: GraphSplit = cut_graph(self.captured.graph, split_points=split_points, balance=balance,
                                           stages=stages, costs=costs)
        self.mode = module.training
        self.mode_dependent = capture_other_mode(module, self.captured, leaves=leaves, sample=args) is not None

    def check_mode(self, training: bool) -> None:
        """Refuse to run in the other mode a forward that records its mode (every rank, before any message).

        Raises:
            StrategyError: the model was captured in the other mode and its forward depends on it.
        """
        if self.mode_dependent and training != self.mode:
            captured, now = ("training", "eval") if self.mode else ("eval", "training")
            raise StrategyError(f"this pipeline was captured in {captured} mode and the model's forward depends on the "
                                f"mode (functional dropout, or BatchNorm under torch.export), so it cannot run in {now} "
                                f"mode; build a second pipeline from the model in {now} mode, or use nn.Dropout")

    def module(self, j: int) -> torch.nn.Module:
        """Stage ``j``'s GraphModule: takes ``split.reads[j]``, returns ``split.sends[j]``."""
        s = self.split
        return stage_module(self.captured, s.reads[j], s.stage_nodes(j), s.sends[j], j)

    def inputs(self, inputs: Any) -> Tuple[Dict[str, Any], Optional[torch.Tensor]]:
        """The call's inputs by value name, and the tensor whose shape keys the step (its batch rows)."""
        args, kwargs = sample_call(inputs)
        values = self.captured.bind(args, kwargs)
        batch_size(values)  # refuses inputs without a batch dimension
        for value in values.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return values, value
        raise StrategyError("the model's inputs hold no tensor with a batch dimension")

    def micro_inputs(self, values: Dict[str, Any], sizes: Sequence[int], device: torch.device) -> List[Dict[str, Any]]:
        """The inputs cut into micro-batches on ``device``."""
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        return split_inputs(moved, sizes)

    def joined_outputs(self, outputs: Sequence[Dict[str, Any]]) -> Any:
        """The model's return value from each micro-batch's outputs (on the last stage)."""
        names = self.split.graph.outputs
        return self.captured.unflatten({v: _joined([o[v] for o in outputs], v) for v in names})

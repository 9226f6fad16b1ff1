"""The graph side of a torch ``DistributedPipeline``: one cut on every rank, this rank's stage, its inputs, outputs.

An ``nn.Sequential`` is a graph too (``graph.chain.ChainPart``): stage j reads what stage j - 1 sends, so chains
and captured models run through the same walk and stage work (``graph_work``).

Every rank captures the model and cuts it alike (the cut must not depend on timing, which differs
between ranks: ``stages=n`` evens out parameter bytes here; measure once with ``ModelParallel(...,
stages=n, sample=...)`` and pass its ``split_points`` for a cut by time), then keeps one stage's
GraphModule, whose ``state_dict`` keys are the full model's.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from dualframe.errors import StrategyError
from dualframe.pipeline.graph import GraphSplit, cut_graph
from dualframe.torch.graph.capture import Captured, Leaves, capture, capture_other_mode, stage_module
from dualframe.torch.pipeline.graph_work import check_crossing
from dualframe.torch.split.loss import loss_value
from dualframe.torch.graph.run import _joined, batch_size, split_inputs
from dualframe.torch.split.graph import _param_bytes


class GraphPart:
    """The model captured and cut on this rank; ``module(j)`` builds stage j (sharing the model's parameters).

    Example:
        >>> part = GraphPart(model, split_points=["blocks.2"])             # doctest: +SKIP
        >>> part.split.stages, part.module(1)                               # doctest: +SKIP
    """

    def __init__(self, module: torch.nn.Module, *, split_points: Optional[Sequence[str]] = None,
                 balance: Optional[Sequence[int]] = None, stages: Optional[int] = None, sample: Any = None,
                 leaves: Leaves = ()) -> None:
        self.captured: Captured = capture(module, leaves=leaves, sample=sample)
        costs = [1.0 + c for c in _param_bytes(self.captured)] if stages is not None else None
        self.split: GraphSplit = cut_graph(self.captured.graph, split_points=split_points, balance=balance,
                                           stages=stages, costs=costs)
        check_crossing(self.captured, self.split)
        self.loss = loss_value(self.captured)  # the output value that is the model's own loss, if any
        self.mode = module.training
        self._other = (module, leaves, sample)
        self.mode_dependent: Optional[bool] = None  # asked the first time a step runs in the other mode

    def check_mode(self, training: bool) -> None:
        """Refuse to run in the other mode a forward that records its mode (every rank, before any message).

        The other mode is captured the first time a step asks for it (not while building: a second
        torch.export would double the build), the same on every rank.

        Raises:
            StrategyError: the model was captured in the other mode and its forward depends on it.
        """
        if training == self.mode:
            return
        if self.mode_dependent is None:
            module, leaves, sample = self._other
            self.mode_dependent = capture_other_mode(module, self.captured, leaves=leaves, sample=sample) is not None
        if self.mode_dependent:
            captured, now = ("training", "eval") if self.mode else ("eval", "training")
            raise StrategyError(f"this pipeline was captured in {captured} mode and the model's forward depends on the "
                                f"mode (functional dropout, or BatchNorm under torch.export), so it cannot run in {now} "
                                f"mode; build a second pipeline from the model in {now} mode, or use nn.Dropout")

    def module(self, j: int) -> torch.nn.Module:
        """Stage ``j``'s GraphModule: takes ``split.reads[j]``, returns ``split.sends[j]``.

        It also holds the model's parameters and buffers that no stage reads (a parameter its forward
        never uses) whose module is nearest to its own, so that the stages' ``state_dict`` merge into the
        model's and ``load_state_dict`` of the model's loads every entry.
        """
        s = self.split
        stage = stage_module(self.captured, s.reads[j], s.stage_nodes(j), s.sends[j], j)
        for key, tensor in self._unread().get(j, []):
            owner, _, leaf = key.rpartition(".")
            holder = _submodule(stage, owner)
            if isinstance(tensor, torch.nn.Parameter):
                holder.register_parameter(leaf, tensor)
            else:
                holder.register_buffer(leaf, tensor)
        return stage

    def _unread(self) -> Dict[int, List[Tuple[str, torch.Tensor]]]:
        """Per stage, the model's ``state_dict`` entries no stage reads that it adopts (the longest shared prefix)."""
        gm, read = self.captured.gm, []
        seen: Set[int] = set()
        for j in range(self.split.stages):
            names: Set[str] = set()
            for node in self.split.stage_nodes(j):
                fx_node = self.captured.nodes[node.name]
                targets = [a.target for a in fx_node.all_input_nodes if a.op == "get_attr"]
                targets += [fx_node.target] if fx_node.op == "call_module" else []
                for target in map(str, targets):
                    found = _tensors(gm, target)
                    names.update(found)
                    seen.update(id(t) for t in found.values())
            read.append(names)
        unread: Dict[int, List[Tuple[str, torch.Tensor]]] = {}
        for key, tensor in self.captured.module.state_dict(keep_vars=True).items():
            if id(tensor) not in seen:
                j = max(range(self.split.stages), key=lambda j: (max((_shared(key, r) for r in read[j]), default=0), j))
                unread.setdefault(j, []).append((key, tensor))
        return unread

    def model_keys(self, stage: torch.nn.Module) -> List[Tuple[str, str]]:
        """(stage key, model key) for every entry of the model's ``state_dict`` that ``stage`` holds, in its order.

        A tensor the model names twice (two names for one parameter) has one name in the traced stage; the
        stage's ``state_dict`` gives it under each of the model's.
        """
        held = {id(t): key for key, t in stage.state_dict(keep_vars=True).items()}
        model = self.captured.module.state_dict(keep_vars=True)
        return [(held[id(t)], key) for key, t in model.items() if id(t) in held]

    def inputs(self, inputs: Any, keywords: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[torch.Tensor]]:
        """The call's inputs by value name, and the tensor whose shape keys the step (its batch rows).

        ``inputs`` is a tuple (positional arguments), a dict of keyword inputs or the only argument
        (``graph_call.as_call``), ``keywords`` more keyword arguments.
        """
        args, kwargs = self.captured.as_call(inputs) if inputs is not None else ((), {})
        values = self.captured.bind(args, {**kwargs, **keywords})
        batch_size(values)  # refuses inputs without a batch dimension
        for value in values.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return values, value
        raise StrategyError("the model's inputs hold no tensor with a batch dimension")

    def micro_inputs(self, values: Dict[str, Any], sizes: Sequence[int], device: torch.device) -> List[Dict[str, Any]]:
        """The inputs cut into micro-batches on ``device``."""
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        return split_inputs(moved, sizes)

    def joined_outputs(self, outputs: Sequence[Dict[str, Any]], weights: Sequence[float]) -> Any:
        """The model's return value from each micro-batch's outputs (on the last stage); the model's own loss
        is their mean weighted by ``weights`` (each micro-batch's share of rows)."""
        names = self.split.graph.outputs
        return self.captured.unflatten({v: _joined([o[v] for o in outputs], v, weights if v == self.loss else None)
                                        for v in names})


def _tensors(gm: torch.nn.Module, target: str) -> Dict[str, torch.Tensor]:
    """The parameters and buffers at ``target``: one tensor, or everything under a module."""
    try:
        found = gm.get_submodule(target)
        return {f"{target}.{k}": t for k, t in found.state_dict(keep_vars=True).items()}
    except AttributeError:
        value = getattr(gm.get_submodule(target.rpartition(".")[0]), target.rpartition(".")[2], None)
        return {target: value} if isinstance(value, torch.Tensor) else {}


def _shared(a: str, b: str) -> int:
    """How many leading dotted components two keys share."""
    count = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        count += 1
    return count


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """``root``'s submodule at ``path``, made (empty) where missing."""
    module = root
    for part in [p for p in path.split(".") if p]:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    return module

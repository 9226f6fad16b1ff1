"""A torch model cut as a graph: capture, cut (the core decides where), one GraphModule per stage on its device.

The stages reference the original model's modules and parameters (no copies, but for a tensor that
stages on different devices read: ``tied_devices``); the split model
registers the original's own parameters, buffers and children under their own names, so its
``state_dict()`` has the original's keys in the original's order and ``parameters()`` its order.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Set, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dualframe.errors import DeviceError, SplitPointError, StrategyError, TraceError
from dualframe.pipeline.graph import GraphSplit, cut_graph, graph_units
from dualframe.pipeline.tied import TiedWeight, tied_description
from dualframe.torch.graph.capture import Captured, Leaves, capture, capture_other_mode, stage_module
from dualframe.torch.graph.cost import BY, Shapes, _attr, measure
from dualframe.torch.graph.run import StepRun, tensor_leaves
from dualframe.torch.split.loss import loss_value
from dualframe.torch.split import devices as tied_devices
from dualframe.torch.split.tied import find_stage_tied, tensor_names
from dualframe.torch.graph.devices import place_stage
from dualframe.torch.split.devices import DeviceCopies



class Binding(Protocol):
    """A split model's call as its graph's input values, and its output values as its return value."""

    def bind(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The call's arguments by input value name."""

    def unflatten(self, values: Dict[str, Any]) -> Any:
        """The model's return value from the output values by name."""


class ModeStages(NamedTuple):
    """One mode's capture (a chain's ``ChainPart``), cut, stage modules and their parameters."""

    captured: Binding
    split: GraphSplit
    modules: List[Any]
    params: List[List[nn.Parameter]]
    loss: Optional[str]  # the output value that is the model's own loss (``model_loss``), if any


class GraphStages:
    """``module`` captured and cut into ``n`` stages, stage j a GraphModule placed on ``devices[j]``.

    Where the forward depends on the mode (functional dropout, BatchNorm under torch.export), the
    other mode is captured too and cut at the same split points; ``view(training)`` picks the stages.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> stages = GraphStages(model, ["cpu", "cpu"], split_points=["2"])
        >>> stages.split.reads, stages.split.sends
        ((('input_1',), ('_1',)), (('_1',), ('_2',)))
    """

    def __init__(self, module: nn.Module, devices: Sequence[str], *, split_points: Optional[Sequence[str]] = None,
                 balance: Optional[Sequence[int]] = None, stages: Optional[int] = None, sample: Any = None,
                 by: str = "time", leaves: Leaves = ()) -> None:
        if by not in BY:
            raise StrategyError(f"by must be one of {', '.join(map(repr, BY))} (by: {by!r})")
        self.captured: Captured = capture(module, leaves=leaves, sample=sample)
        args, kwargs = self.captured.as_call(sample) if sample is not None else ((), {})
        costs = sizes = None
        self.shapes: Shapes = {}  # values' shapes: from the sample, then from each step's micro-batch 0
        if stages is not None:
            units = graph_units(self.captured.graph)
            if isinstance(stages, int) and not isinstance(stages, bool) and stages > len(units):
                cut_graph(self.captured.graph, stages=stages)  # refuses, naming the units, before measuring
            if sample is not None:
                costs, sizes, self.shapes = measure(self.captured, self.captured.bind(args, kwargs), by)
            else:  # no sample: even parameter bytes, a guess that needs no compute
                costs = [1.0 + c for c in _param_bytes(self.captured)]
        self.split: GraphSplit = cut_graph(self.captured.graph, split_points=split_points, balance=balance,
                                           stages=stages, costs=costs, sizes=sizes)
        if sample is not None and stages is None:  # the cut is valid: now the sample may run, for describe()
            self.shapes = measure(self.captured, self.captured.bind(args, kwargs), "memory").shapes
        self.shapes_from = "the sample" if sample is not None else ""
        self.devices = [torch.device(d) for d in devices]
        if self.split.stages != len(self.devices):
            raise DeviceError(f"one device per stage (stages: {self.split.stages}, devices: {list(devices)})")
        self.copies = DeviceCopies(self.devices, tensor_names(module), one_device=tied_devices.COPY_ON_ONE_DEVICE)
        self.modules, self.tied = self._place(self.captured, self.split)
        self.params = [list(stage.parameters()) for stage in self.modules]
        self.mode = module.training
        self._modes = {self.mode: ModeStages(self.captured, self.split, self.modules, self.params,
                                             loss_value(self.captured))}
        self._other = (module, leaves, sample)  # the other mode is captured when first run (one capture to build)

    def _other_mode(self, other: Captured) -> ModeStages:
        """The other mode's stages, cut where this mode's are."""
        try:
            split = cut_graph(other.graph, split_points=self.split.split_points)
        except SplitPointError as error:
            mode = "eval" if self.mode else "training"
            raise TraceError(f"in {mode} mode the model runs a different graph, where the cut fails ({error}); "
                             "split it in the mode you run it, or keep mode-dependent code in leaf modules "
                             "(nn.Dropout, not F.dropout(training=self.training))") from None
        modules, _ = self._place(other, split)
        return ModeStages(other, split, modules, [list(stage.parameters()) for stage in modules], loss_value(other))

    def _place(self, captured: Captured, split: GraphSplit) -> Tuple[List[Any], List[TiedWeight]]:
        """Stage modules on their devices (a tensor read on several devices copied to the later ones), and the
        parameters several stages read (found before the copies replace them)."""
        modules = [stage_module(captured, split.reads[j], split.stage_nodes(j), split.sends[j], j)
                   for j in range(split.stages)]
        tied = find_stage_tied(captured.module, modules)
        self.copies.place(modules)
        for stage, device in zip(modules, self.devices):
            place_stage(stage, device)
        return modules, tied

    def view(self, training: bool) -> ModeStages:
        """The stages to run in ``training`` mode (the same for both modes where the forward does not differ).

        The other mode is captured the first time it runs, and its stages cut where this mode's are.
        """
        if training not in self._modes:
            module, leaves, sample = self._other
            other = capture_other_mode(module, self.captured, leaves=leaves, sample=sample)
            self._modes[training] = self._other_mode(other) if other is not None else self._modes[self.mode]
        return self._modes[training]

    def run(self, view: ModeStages, plan: Any, parts: Sequence[Dict[str, Any]], **walk: Any) -> StepRun:
        """A step of ``view`` (from ``view(training)``) over ``parts`` (micro-batches of the inputs); value shapes
        are noted from micro-batch 0."""
        shapes: Shapes = {}
        for name in view.split.graph.inputs:
            shapes[name] = [(tuple(t.shape), t.dtype) for t in tensor_leaves(parts[0][name])]
        if view.split is self.split:  # describe() shows the capture mode's cut
            self.shapes, self.shapes_from = shapes, "micro-batch 0 of the last step"
        return StepRun(view.modules, self.devices, plan, view.split, parts, view.params, shapes=shapes,
                       masters=self.copies.masters, loss=view.loss, **walk)

    def unit_balance(self) -> Optional[List[int]]:
        """Top-level units per stage, or None when a cut falls inside a unit."""
        starts = [u.start for u in graph_units(self.captured.graph)]
        if any(s not in starts for s in self.split.starts):
            return None
        index = [starts.index(s) for s in self.split.starts] + [len(starts)]
        return [index[j + 1] - index[j] for j in range(self.split.stages)]

    def describe(self) -> str:
        """Cut points and, per boundary, the values crossing it with shapes and bytes (last step's micro-batch 0)."""
        split = self.split
        lines = [f"{type(self.captured.module).__name__} captured with torch.{self.captured.method}, "
                 f"{split.stages} stages, cut at {list(split.split_points)}"
                 + (f" (shapes of {self.shapes_from})" if self.shapes_from else "")]
        for j in range(split.stages):
            nodes = split.stage_nodes(j)
            scopes = [node.scope for node in nodes if node.scope] or [nodes[0].name]
            first, last = scopes[0], scopes[-1]
            lines.append(f"  stage {j} on {self.devices[j]}: {len(nodes)} ops, {first} .. {last}")
            if j + 1 == split.stages:
                break
            lines.append(f"  boundary {j}|{j + 1}:")
            for name in split.crossing(j):
                readers = [c for c in split.consumers.get(name, ()) if c > j]
                to = ", ".join("output" if c == split.stages else f"stage {c}" for c in readers)
                source = "input" if split.producer[name] < 0 else f"stage {split.producer[name]}"
                lines.append(f"    {name}: {_shape_text(self.shapes.get(name))} ({source} -> {to})")
        return "\n".join(lines + tied_description(self.tied) + self.copies.describe())


def _shape_text(shapes: Optional[List[Tuple[Tuple[int, ...], torch.dtype]]]) -> str:
    if shapes is None:
        return "shape not seen yet (run a step or pass sample=)"
    if not shapes:
        return "no tensor (a size, a flag or None: sent as data)"
    parts, total = [], 0
    for shape, dtype in shapes:
        count = 1
        for d in shape:
            count *= d
        total += count * torch.empty((), dtype=dtype).element_size()
        parts.append(f"{list(shape)} {str(dtype).replace('torch.', '')}")
    return f"{', '.join(parts)}, {_bytes(total)}"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _param_bytes(captured: Captured) -> List[float]:
    """Per node, the bytes of the parameters it reads first: those of the module it calls, or (torch.export,
    functional code) those it reads as attributes; a parameter read by several nodes counts at the first."""
    out: List[float] = []
    seen: Set[int] = set()
    for node in captured.graph.nodes:
        fx_node = captured.nodes[node.name]
        if fx_node.op == "call_module":
            params = list(captured.gm.get_submodule(str(fx_node.target)).parameters())
        else:
            params = [_attr(captured.gm, str(a.target)) for a in fx_node.all_input_nodes if a.op == "get_attr"]
        fresh = [p for p in params if isinstance(p, nn.Parameter) and id(p) not in seen]
        seen.update(id(p) for p in fresh)
        out.append(float(sum(p.numel() * p.element_size() for p in fresh)))
    return out


class GraphFunction(torch.autograd.Function):
    """A graph step as one node of the caller's graph: inputs' tensors and parameters in, outputs' tensors out."""

    @staticmethod
    def forward(ctx: Any, run: StepRun, layout: Any, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.run, ctx.layout = run, layout
        ctx.devices = [t.device for t in tensors]  # an input's gradient must come back on its device
        outputs = run.forward(grad=True)
        layout.outputs = outputs
        layout.output_counts = [(name, len(tensor_leaves(outputs[name]))) for name in layout.output_names]
        return tuple(t for name in layout.output_names for t in tensor_leaves(outputs[name]))

    @staticmethod
    def backward(  # type: ignore[override]
            ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError("a pipeline step can be back-propagated once; run the forward again")
        layout, it = ctx.layout, iter(grads)
        per_output = {name: [next(it) for _ in range(count)] for name, count in layout.output_counts}
        input_grads, param_grads = run.backward(per_output)
        flat = [g for name in layout.input_names for g in input_grads[name]]
        moved = [g if g is None else g.to(d) for g, d in zip([*flat, *param_grads], ctx.devices)]
        return (None, None, *moved)


class Layout:
    """Which tensors of the call go through ``GraphFunction``: each input's and output's tensor leaves."""

    def __init__(self, input_names: Sequence[str], output_names: Sequence[str]) -> None:
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.outputs: Dict[str, Any] = {}
        self.output_counts: List[Tuple[str, int]] = []

    def rebuild(self, flat: Sequence[torch.Tensor]) -> Dict[str, Any]:
        """The outputs with their tensors replaced by the Function's outputs (which carry the grad_fn)."""
        it = iter(flat)
        values: Dict[str, Any] = {}
        for name in self.output_names:
            value = self.outputs[name]
            values[name] = next(it) if isinstance(value, torch.Tensor) else \
                pytree.tree_map(lambda t: next(it) if isinstance(t, torch.Tensor) else t, value)
        return values

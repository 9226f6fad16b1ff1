"""Measure a torch model for ``dualframe plan`` on the ``meta`` device: no weight or activation is allocated.

The model is built under ``torch.device("meta")``; one forward pass on a meta batch records, per
node, what autograd saves for the backward pass (``saved_tensors_hooks``) and the size of its
output. A ``Sequential`` is a chain whose children are the nodes. Any other model is a graph: its
nodes are its submodules where a stage may begin (top-level children, and the children of
``Sequential``/``ModuleList``/``ModuleDict`` containers, recursively), in the order they run, and a
``TorchFunctionMode`` follows every tensor from the node that makes it to the last node that reads
it (skip tensors, masks, the glue code of the model's ``forward``). The result is the core's plain
``ModelProfile``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from dualframe.plan.profile import LayerProfile, ModelProfile, Value

#: The probe runs a batch of this many rows and divides, so BatchNorm and friends see a real batch.
PROBE_BATCH = 2
#: Containers a stage may begin inside: they only hold modules, their parent's forward calls them.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def build_on_meta(builder: Callable[[], Any]) -> Any:
    """Call ``builder`` with ``meta`` as the default device, so its weights take no memory."""
    with torch.device("meta"):
        return builder()


def top_level_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The layers a ``balance`` counts: a Sequential's children, else the model's direct children."""
    children = list(model.named_children())
    return children if children else [(type(model).__name__, model)]


def graph_nodes(model: nn.Module, prefix: str = "") -> List[Tuple[str, nn.Module]]:
    """Submodules where a stage may begin, by qualified name: children, looking inside containers."""
    found: List[Tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS) and len(child):
            found += graph_nodes(child, f"{prefix}{name}.")
        else:
            found.append((prefix + name, child))
    return found


def _float_elements(tensor: torch.Tensor) -> float:
    # Non-float tensors (dropout masks, pooling indices) are counted by their bytes in float32 units.
    if tensor.is_floating_point():
        return float(tensor.numel())
    return tensor.numel() * tensor.element_size() / 4.0


def _tensors(tree: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Recorder:
    """Attributes what autograd saves, and each node's output, to the node running (by run order)."""

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        self.current = 0
        self.order: List[int] = []           # node indices (in graph_nodes order) as they first ran
        self.saved: Dict[int, float] = {}
        self.largest: Dict[int, float] = {}
        self.output: Dict[int, float] = {}
        self._parameters = {id(p) for p in parameters}
        self._seen: Dict[int, torch.Tensor] = {}  # keeps bases alive so ids stay unique

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self._parameters and id(base) not in self._seen:
            self._seen[id(base)] = base
            size = _float_elements(base) / PROBE_BATCH
            self.saved[self.current] = self.saved.get(self.current, 0.0) + size
            self.largest[self.current] = max(self.largest.get(self.current, 0.0), size)
        return tensor

    def hooks(self, index: int) -> Tuple[Callable[..., None], Callable[..., None]]:
        def before(module: nn.Module, args: Any) -> None:
            if index not in self.order:       # a module run twice counts where it first ran
                self.order.append(index)
                self.current = len(self.order) - 1

        def after(module: nn.Module, args: Any, output: Any) -> None:
            position = self.order.index(index)
            size = sum(_float_elements(t) for t in _tensors(output)) / PROBE_BATCH
            self.output[position] = size
            self.largest[position] = max(self.largest.get(position, 0.0), size)

        return before, after


class _Flow(TorchFunctionMode):
    """Follows tensors between nodes: who made each (the node running then), who read it last.

    Code between nodes (a ``forward``'s glue) counts with the node that ran before it.
    """

    def __init__(self, recorder: _Recorder, owned: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.recorder = recorder
        self.made: Dict[int, Tuple[torch.Tensor, int, float]] = {}
        self.last: Dict[int, int] = {}
        self.owned = {id(p) for p in owned}
        self.state: set = set()    # buffers (BatchNorm statistics): the model's state, not values
        self.stray: Dict[int, Tuple[torch.Tensor, int]] = {}  # parameters no node owns: first reader

    def add(self, tensor: torch.Tensor, producer: int) -> None:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self.made:
            self.made[id(base)] = (base, producer, _float_elements(base) / PROBE_BATCH)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        produced = _tensors(output)
        if produced:                # reading a shape or a dtype does not keep a tensor alive
            current = self.recorder.current
            for tensor in _tensors((args, kwargs)):
                if isinstance(tensor, nn.Parameter):
                    if id(tensor) not in self.owned and id(tensor) not in self.stray:
                        self.stray[id(tensor)] = (tensor, current)
                    continue
                base = tensor._base if tensor._base is not None else tensor
                if id(base) in self.made:
                    self.last[id(base)] = current
            for tensor in produced:
                if id(tensor) not in self.state and (tensor._base is None or id(tensor._base) not in self.state):
                    self.add(tensor, current)
        return output

    def values(self) -> List[Value]:
        return [Value(producer, self.last[key], elements) for key, (_, producer, elements) in self.made.items()
                if self.last.get(key, producer) > producer and elements > 0]


def profile_module(model: nn.Module, input_shape: Sequence[int], input_dtype: str = "float32",
                   source: str = "") -> ModelProfile:
    """Profile ``model`` (ideally on ``meta``) with one forward pass on a ``meta`` batch.

    Args:
        model: the model; a Sequential's children, or a graph's nodes (``graph_nodes``), are the
            units a ``balance`` counts and the places a stage may begin.
        input_shape: one sample's shape (without the batch dimension).
        input_dtype: ``"float32"``, or ``"int64"`` for token ids.
        source: where the model came from, for the report.

    Returns:
        The ModelProfile (per-sample activation elements, parameter counts per node and, for a
        graph, the values between nodes).
    """
    chain = isinstance(model, nn.Sequential) or not list(model.children())
    named = top_level_layers(model) if chain else graph_nodes(model)
    batch = torch.zeros((PROBE_BATCH, *input_shape), dtype=getattr(torch, input_dtype), device="meta")
    recorder, flow = _run(model.to("meta"), named, batch)
    ran = recorder.order + [j for j in range(len(named)) if j not in recorder.order]
    layers = [_layer(named[j], position, recorder, flow, _split_point(model, named, ran, position))
              for position, j in enumerate(ran)]
    unowned = sum(b.numel() for b in model.buffers()) - sum(b.numel() for _, node in named for b in node.buffers())
    if unowned:
        first = layers[0]
        layers[0] = LayerProfile(first.name, first.parameters, first.frozen + unowned, first.activations,
                                 first.output, first.largest, first.split_point)
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = str(floats[0] if floats else torch.float32).replace("torch.", "")
    elements = float(torch.Size(input_shape).numel())
    values = [] if chain else flow.values()
    return ModelProfile("torch", source, tuple(input_shape), layers, elements, dtype, values=values)


def _run(model: nn.Module, named: Sequence[Tuple[str, nn.Module]], batch: torch.Tensor) -> Tuple[_Recorder, _Flow]:
    """One training-mode forward pass with the nodes hooked, the saved tensors and the values recorded."""
    recorder = _Recorder(list(model.parameters()))
    flow = _Flow(recorder, [p for _, node in named for p in node.parameters()])
    handles = []
    for index, (_, layer) in enumerate(named):
        before, after = recorder.hooks(index)
        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    flow.add(batch, -1)
    flow.state.update(id(b) for b in model.buffers())
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda tensor: tensor), flow:
            model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return recorder, flow


def _split_point(model: nn.Module, named: Sequence[Tuple[str, nn.Module]], ran: Sequence[int], position: int) -> str:
    """The outermost name that begins with this node: ``"layer3"`` for ``"layer3.0"`` when it runs first there.

    Only a ``Sequential`` is climbed: it runs as one piece, so its name is a place where a stage may
    begin. A ``ModuleList``/``ModuleDict`` is never called (its parent's ``forward`` runs its children,
    maybe with code between them), so a stage begins at a child: ``"blocks.6"``.
    """
    name = named[ran[position]][0]
    parts = name.split(".")
    for length in range(1, len(parts)):
        prefix = ".".join(parts[:length])
        if not isinstance(model.get_submodule(prefix), nn.Sequential):
            continue
        first = next(j for j in ran if named[j][0].startswith(prefix + "."))
        if named[first][0] == name:
            return prefix
    return name


def _layer(node: Tuple[str, nn.Module], position: int, recorder: _Recorder, flow: _Flow,
           split_point: str) -> LayerProfile:
    name, layer = node
    trainable = sum(p.numel() for p in layer.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in layer.parameters() if not p.requires_grad)
    frozen += sum(b.numel() for b in layer.buffers())
    for tensor, reader in flow.stray.values():   # e.g. a position embedding read by the model's forward
        if reader == position:
            trainable += tensor.numel() if tensor.requires_grad else 0
            frozen += 0 if tensor.requires_grad else tensor.numel()
    return LayerProfile(name, trainable, frozen, recorder.saved.get(position, 0.0), recorder.output.get(position, 0.0),
                        recorder.largest.get(position, 0.0), split_point)


def visible_devices() -> List[Dict[str, Any]]:
    """The CUDA devices torch sees, with their memory in bytes (empty on a CPU-only machine)."""
    return [{"name": f"cuda:{i}", "memory": torch.cuda.get_device_properties(i).total_memory}
            for i in range(torch.cuda.device_count())]


def profile(target: Any, input_shape: Sequence[int], input_dtype: str = "float32",
            source: str = "") -> Optional[ModelProfile]:
    """Profile a builder (called on ``meta``) or an already built module; None if it is not torch."""
    model = build_on_meta(target) if callable(target) and not isinstance(target, nn.Module) else target
    if not isinstance(model, nn.Module):
        return None
    return profile_module(model, input_shape, input_dtype, source)

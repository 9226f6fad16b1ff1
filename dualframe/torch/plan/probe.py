"""Measure a torch model for ``dualframe plan`` on the ``meta`` device: no weight or activation is allocated.

The model is built under ``torch.device("meta")``; one forward pass on a meta batch records, per
node, what autograd saves for the backward pass (``saved_tensors_hooks``) and the size of its
output. A ``Sequential`` is a chain whose children are the nodes. Any other model is a graph: its
nodes are its submodules where a stage may begin (top-level children, and the children of
``Sequential``/``ModuleList``/``ModuleDict`` containers, recursively, and inside the modules that
hold a model's stack of repeated blocks), in the order they run, and a ``TorchFunctionMode``
follows every tensor from the node that makes it to the last node that reads it (skip tensors,
masks, the glue code of the model's ``forward``) and every parameter to the nodes that read it (a
tied embedding and head: counted once, shared). A model with blocks (``transformer.h.0`` ..) is
then merged into one node per block, the units its split counts. A model whose ``forward`` takes
``input_ids`` is called as one: ``input_ids=`` and ``attention_mask=`` keywords. The result is the
core's plain ``ModelProfile``.
"""
from __future__ import annotations

import inspect
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from dualframe.pipeline.units import block_units
from dualframe.plan.profile import LayerProfile, ModelProfile, Shared, Value
from dualframe.plan.units import merge_units

#: The probe runs a batch of this many rows and divides, so BatchNorm and friends see a real batch.
PROBE_BATCH = 2
#: Containers a stage may begin inside: they only hold modules, their parent's forward calls them.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
#: Reading a tensor's value (transformers asks whether a mask is all ones to skip it).
_VALUE_READS = (torch.Tensor.item, torch.Tensor.__bool__)


def build_on_meta(builder: Callable[[], Any]) -> Any:
    """Call ``builder`` with ``meta`` as the default device, so its weights take no memory."""
    with torch.device("meta"):
        return builder()


def to_meta(model: nn.Module) -> nn.Module:
    """``model`` on ``meta``, its tied parameters still one tensor (``Module.to`` would make a copy per holder)."""
    if all(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return model
    holders: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None:
                holders.setdefault(id(parameter), []).append((module, name))
    model.to("meta")
    for tied in holders.values():
        first, name = tied[0]
        for module, other in tied[1:]:
            setattr(module, other, getattr(first, name))
    return model


def top_level_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The layers a ``balance`` counts: a Sequential's children, else the model's direct children."""
    children = list(model.named_children())
    return children if children else [(type(model).__name__, model)]


def block_lists(model: nn.Module) -> Set[str]:
    """The model's stacks of repeated blocks, by name (GPT-2's ``transformer.h``), as the torch split finds them.

    A block list is a ``ModuleList`` of two or more modules of one class of the model's own (not
    ``torch.nn``), outermost only, and the block lists together hold at least half the parameters.
    """
    named = dict(model.named_modules())
    lists = [name for name, m in named.items() if isinstance(m, nn.ModuleList) and len(m) >= 2
             and len({type(b) for b in m}) == 1 and not type(m[0]).__module__.startswith("torch.nn")]
    lists = [name for name in lists if not any(name.startswith(other + ".") for other in lists)]
    held = sum(p.numel() for name in lists for p in named[name].parameters())
    return set(lists) if lists and 2 * held >= sum(p.numel() for p in model.parameters()) else set()


def graph_nodes(model: nn.Module, prefix: str = "", lists: AbstractSet[str] = frozenset()) -> List[Tuple[str, nn.Module]]:
    """Submodules where a stage may begin, by qualified name: children, looking inside containers and block holders."""
    found: List[Tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        path = prefix + name
        holds_blocks = any(other.startswith(path + ".") for other in lists)
        if (isinstance(child, CONTAINERS) and len(child)) or holds_blocks:
            found += graph_nodes(child, path + ".", lists)
        else:
            found.append((path, child))
    return found


def model_call(model: nn.Module, input_shape: Sequence[int], input_dtype: str,
               input_names: Sequence[str] = ()) -> Dict[str, torch.Tensor]:
    """The ``meta`` batch as the model is called: ``{"": batch}`` positionally, else one tensor per keyword.

    With no names, a model whose ``forward`` takes ``input_ids`` gets token ids there and, when it
    takes one, an ``attention_mask`` of ones. A name with ``mask`` in it is a mask (int64 ones).
    """
    names = list(input_names)
    parameters = inspect.signature(model.forward).parameters
    if not names and input_dtype.startswith("int") and "input_ids" in parameters:
        names = ["input_ids"] + (["attention_mask"] if "attention_mask" in parameters else [])
    shape = (PROBE_BATCH, *input_shape)
    if not names:
        return {"": torch.zeros(shape, dtype=getattr(torch, input_dtype), device="meta")}
    return {name: torch.ones(shape, dtype=torch.int64, device="meta") if "mask" in name
            else torch.zeros(shape, dtype=getattr(torch, input_dtype), device="meta") for name in names}


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

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.made: Dict[int, Tuple[torch.Tensor, int, float]] = {}
        self.last: Dict[int, int] = {}
        self.state: set = set()    # buffers (BatchNorm statistics): the model's state, not values
        self.reads: Dict[int, Tuple[torch.Tensor, Set[int]]] = {}  # each parameter: the nodes reading it

    def add(self, tensor: torch.Tensor, producer: int) -> None:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self.made:
            self.made[id(base)] = (base, producer, _float_elements(base) / PROBE_BATCH)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _VALUE_READS and any(t.is_meta for t in _tensors(args)):
            return True   # a meta tensor has no value: answer as for the probe's all-ones mask
        output = func(*args, **(kwargs or {}))
        produced = _tensors(output)
        if produced:                # reading a shape or a dtype does not keep a tensor alive
            current = self.recorder.current
            for tensor in _tensors((args, kwargs)):
                if isinstance(tensor, nn.Parameter):
                    self.reads.setdefault(id(tensor), (tensor, set()))[1].add(current)
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
                   source: str = "", input_names: Sequence[str] = ()) -> ModelProfile:
    """Profile ``model`` (ideally on ``meta``) with one forward pass on a ``meta`` batch.

    Args:
        model: the model; a Sequential's children, or a graph's nodes (``graph_nodes``; with a stack
            of repeated blocks, one unit per block), are the units a ``balance`` counts and the
            places a stage may begin.
        input_shape: one sample's shape (without the batch dimension); every keyword input's.
        input_dtype: ``"float32"``, or ``"int64"`` for token ids.
        source: where the model came from, for the report.
        input_names: keyword inputs (``input_ids,attention_mask``); see ``model_call``.

    Returns:
        The ModelProfile (per-sample activation elements, parameter counts per node, each counted
        once, the parameters several nodes read and, for a graph, the values between nodes).
    """
    chain = isinstance(model, nn.Sequential) or not list(model.children())
    lists = set() if chain else block_lists(model)
    named = top_level_layers(model) if chain else graph_nodes(model, lists=lists)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        setattr(config, "use_cache", False)   # training keeps no key/value cache
    inputs = model_call(model, input_shape, input_dtype, input_names)
    recorder, flow = _run(to_meta(model), named, inputs)
    ran = recorder.order + [j for j in range(len(named)) if j not in recorder.order]
    counts, shared = _parameters(model, named, ran, flow)
    layers = [_layer(named[j], position, recorder, counts[position], _split_point(model, named, ran, position))
              for position, j in enumerate(ran)]
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = str(floats[0] if floats else torch.float32).replace("torch.", "")
    elements = float(torch.Size(input_shape).numel()) * len(inputs)
    values = [] if chain else flow.values()
    profile = ModelProfile("torch", source, tuple(input_shape), layers, elements, dtype, values=values, shared=shared)
    names = [named[j][0] for j in ran]
    return merge_units(profile, block_units(names, [name.rpartition(".")[0] in lists for name in names]))


def _parameters(model: nn.Module, named: Sequence[Tuple[str, nn.Module]], ran: Sequence[int],
                flow: _Flow) -> Tuple[List[Tuple[int, int]], List[Shared]]:
    """(trainable, frozen) elements per node in run order, each tensor at its first reader, and the shared ones.

    A node reads its own parameters and those its code (or the glue after it) passes to an op; a
    buffer no node owns (the model's own) goes to the first node.
    """
    readers: Dict[int, Tuple[torch.Tensor, Set[int]]] = {}
    for position, j in enumerate(ran):
        for parameter in named[j][1].parameters():
            readers.setdefault(id(parameter), (parameter, set()))[1].add(position)
    for key, (read_tensor, read) in flow.reads.items():
        readers.setdefault(key, (read_tensor, set()))[1].update(read)
    counts = [[0, 0] for _ in ran]
    shared = []
    for tensor, read in readers.values():
        home = min(read)
        counts[home][0 if tensor.requires_grad else 1] += tensor.numel()
        if tensor.requires_grad and len(read) > 1:
            shared.append(Shared(tensor.numel(), tuple(read)))
    for position, j in enumerate(ran):
        counts[position][1] += sum(b.numel() for b in named[j][1].buffers())
    counts[0][1] += sum(b.numel() for b in model.buffers()) - sum(b.numel() for _, node in named for b in node.buffers())
    return [(t, f) for t, f in counts], shared


def _run(model: nn.Module, named: Sequence[Tuple[str, nn.Module]],
         inputs: Dict[str, torch.Tensor]) -> Tuple[_Recorder, _Flow]:
    """One training-mode forward pass with the nodes hooked, the saved tensors and the values recorded."""
    recorder = _Recorder(list(model.parameters()))
    flow = _Flow(recorder)
    handles = []
    for index, (_, layer) in enumerate(named):
        before, after = recorder.hooks(index)
        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    for tensor in inputs.values():
        flow.add(tensor, -1)
    flow.state.update(id(b) for b in model.buffers())
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda tensor: tensor), flow:
            if "" in inputs:
                model(inputs[""])
            else:
                model(**inputs)
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


def _layer(node: Tuple[str, nn.Module], position: int, recorder: _Recorder, counts: Tuple[int, int],
           split_point: str) -> LayerProfile:
    return LayerProfile(node[0], counts[0], counts[1], recorder.saved.get(position, 0.0),
                        recorder.output.get(position, 0.0), recorder.largest.get(position, 0.0), split_point)


def visible_devices() -> List[Dict[str, Any]]:
    """The CUDA devices torch sees, with their memory in bytes (empty on a CPU-only machine)."""
    return [{"name": f"cuda:{i}", "memory": torch.cuda.get_device_properties(i).total_memory}
            for i in range(torch.cuda.device_count())]


def profile(target: Any, input_shape: Sequence[int], input_dtype: str = "float32",
            source: str = "", input_names: Sequence[str] = ()) -> Optional[ModelProfile]:
    """Profile a builder (called on ``meta``) or an already built module; None if it is not torch."""
    model = build_on_meta(target) if callable(target) and not isinstance(target, nn.Module) else target
    if not isinstance(model, nn.Module):
        return None
    return profile_module(model, input_shape, input_dtype, source, input_names)

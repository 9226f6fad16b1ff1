"""Capturing a torch model as the core's ``Graph``: torch.fx symbolic tracing, torch.export as the fallback.

torch.fx runs ``forward`` once on proxies and records every call; modules of ``torch.nn`` itself
(``nn.Linear``, ``nn.BatchNorm2d``, ``nn.TransformerEncoderLayer``, ...) stay leaves, called as one
node whose insides cannot be cut, and so do the modules named in ``leaves``. When fx cannot trace
(Python control flow on a tensor's shape, a call that needs a real tensor), ``torch.export`` tries on
the ``sample`` batch: it runs the model on fake tensors with the batch dimension left free, so
branches on static shapes are taken once, and records aten ops with the module path of each.
Control flow on tensor *values* neither can capture: the error says where and what to do.

Values are the fx nodes' names; ``get_attr`` nodes (parameters, buffers, constants read by
functional code) are not values: each stage that reads one gets its own reference.
"""
from __future__ import annotations

import functools
import inspect
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from dualframe.errors import TraceError
from dualframe.pipeline.graph import Graph, GraphNode
from dualframe.torch.graph.call import Call, ExportCall, as_call, canonical
from dualframe.torch.graph.grads import check_gradients, recording_functions

Leaves = Iterable[Union[str, Type[nn.Module]]]


class LeafTracer(fx.Tracer):
    """fx's tracer with the default leaf rule (``torch.nn`` built-ins) plus named modules or classes."""

    def __init__(self, leaves: Leaves = ()) -> None:
        super().__init__()
        items = list(leaves)
        self.names = {item for item in items if isinstance(item, str)}
        self.types = tuple(item for item in items if isinstance(item, type))

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:  # noqa: D102
        if module_qualified_name in self.names or (self.types and isinstance(m, self.types)):
            return True
        return super().is_leaf_module(m, module_qualified_name)


@dataclass
class Captured:
    """A model's forward as an fx ``GraphModule`` and as the core's ``Graph`` (same value names).

    Example:
        >>> captured = capture(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        >>> captured.method, [node.scope for node in captured.graph.nodes]
        ('fx', ['0', '1'])
    """

    module: nn.Module
    gm: fx.GraphModule
    method: str                       # "fx" or "export"
    graph: Graph
    nodes: Dict[str, fx.Node] = field(default_factory=dict)  # value name -> its fx node
    export_call: Optional[ExportCall] = None  # how torch.export was called (its inputs' form)

    def bind(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The model's call arguments as {input value name: value}."""
        owner = type(self.module).__name__
        if self.export_call is not None:
            flat = self.export_call.leaves(canonical(self.signature(), tuple(args), kwargs, owner), owner)
            return dict(zip(self.graph.inputs, flat))
        signature = self.signature()
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{owner}.forward{signature}: {error}") from None
        bound.apply_defaults()
        return dict(zip(self.graph.inputs, bound.arguments.values()))  # placeholders follow the signature

    def signature(self) -> inspect.Signature:
        """The model's ``forward`` signature."""
        return forward_signature(self.module)

    def as_call(self, inputs: Any) -> Call:
        """One object standing for a call (a tuple, a dict of keyword inputs, one value) as (args, kwargs)."""
        return as_call(inputs, self.signature())

    def unflatten(self, values: Dict[str, Any]) -> Any:
        """The model's return value, built from {output value name: value}."""
        output = next(n for n in self.gm.graph.nodes if n.op == "output")
        structure = output.args[0]
        if self.method == "export":
            spec = self.gm._graph._codegen.pytree_info.out_spec  # type: ignore[attr-defined]
            flat = [values[n.name] if isinstance(n, fx.Node) else n for n in structure]
            return pytree.tree_unflatten(flat, spec) if spec is not None else flat
        return fx.node.map_arg(structure, lambda n: values[n.name])


def forward_signature(module: nn.Module) -> inspect.Signature:
    """``module.forward``'s signature (cached on the class: it is asked on every step)."""
    cls = type(module)
    cached = _SIGNATURES.get(cls)
    if cached is None or "forward" in module.__dict__:
        cached = inspect.signature(module.forward)
        if "forward" not in module.__dict__:
            _SIGNATURES[cls] = cached
    return cached


_SIGNATURES: Dict[type, inspect.Signature] = {}


def capture(module: nn.Module, *, leaves: Leaves = (), sample: Any = None) -> Captured:
    """Capture ``module``'s forward: torch.fx first, torch.export on ``sample`` when fx cannot.

    Args:
        module: any ``nn.Module``.
        leaves: qualified module names (``"blocks.3"``) or module classes kept whole, beyond ``torch.nn``'s.
        sample: one call's inputs, needed for the torch.export fallback: a tuple (positional arguments), a
            dict of keyword inputs (``{"input_ids": ..., "attention_mask": ...}``) or the only argument.

    Raises:
        TraceError: neither can capture it; the message says why (and where) and what to do.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module (module: {type(module).__name__})")
    try:
        gm = fx.GraphModule(module, LeafTracer(leaves).trace(module), class_name=type(module).__name__)
        return _captured(module, gm, "fx")
    except Exception as error:  # fx raises anything a proxy cannot do (TraceError, TypeError, ...)
        fx_error = _why(error, module)
    if sample is None:
        raise TraceError(
            f"torch.fx cannot trace {type(module).__name__}: {fx_error}. Pass sample=(inputs,) so that torch.export "
            f"can try, mark the module that fails as a leaf (leaves=[name or class]; its insides are then not cut), "
            f"or make its control flow static (no Python branch on a tensor)") from None
    try:
        call = canonical(forward_signature(module), *as_call(sample, forward_signature(module)), type(module).__name__)
        with recording_functions() as functions:
            gm, how = _export(module, call)
        captured = _captured(module, gm, "export")
        captured.export_call = how
    except Exception as error:
        export_error = _why(error, module)
    else:
        check_gradients(module, gm, call, ExportCall.split(call)[0], functions)
        return captured
    raise TraceError(
        f"{type(module).__name__} cannot be captured as a graph. torch.fx: {fx_error}. torch.export: {export_error}. "
        f"Mark the module that fails as a leaf (leaves=[name or class]; it then runs in one stage), or make the "
        f"control flow static: branch on shapes or flags, not on tensor values (torch.where, torch.cond)") from None


def capture_other_mode(module: nn.Module, captured: Captured, *, leaves: Leaves = (),
                       sample: Any = None) -> Optional[Captured]:
    """``module`` captured in the other mode (eval if it was captured training), or None where the code is the same.

    Both captures record the mode as a constant: ``F.dropout(x, training=self.training)``, and every
    BatchNorm under torch.export, run as captured whatever ``train()``/``eval()`` says later. Each
    module's own flag is restored afterwards.

    Raises:
        TraceError: the model cannot be captured in the other mode.
    """
    flags = [(m, m.training) for m in module.modules()]
    module.train(not module.training)
    try:
        other = capture(module, leaves=leaves, sample=sample if captured.method == "export" else None)
    finally:
        for m, flag in flags:
            m.training = flag
    return None if other.gm.code == captured.gm.code else other


def _why(error: BaseException, module: nn.Module) -> str:
    """The error's first line, with the innermost submodule of ``module`` whose forward raised it."""
    names = {id(m): name for name, m in module.named_modules()}
    where = ""
    for frame, line in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names and frame.f_code.co_name == "forward":
            label = names[id(owner)] or "the model"
            where = f" (in {label}: {type(owner).__name__}.forward, line {line})"
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text[:300]}{where}"


def _export(module: nn.Module, call: Call) -> Tuple[fx.GraphModule, ExportCall]:
    """torch.export on ``call``, its tensor-free keyword arguments (flags) bound into ``forward`` as constants."""
    (args, kwargs), constants = ExportCall.split(call)
    batch = torch.export.Dim.AUTO  # micro-batches differ in rows: keep dimension 0 free
    bound = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)  # export's own keys
    dynamic = pytree.tree_map(lambda t: {0: batch} if isinstance(t, torch.Tensor) and t.dim() else None, bound)
    own = module.__dict__.get("forward")
    if constants:
        module.forward = functools.partial(type(module).forward.__get__(module), **constants)  # type: ignore[method-assign]
    try:
        program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic, strict=False)
    finally:
        if constants:
            if own is None:
                del module.forward
            else:
                module.forward = own  # type: ignore[method-assign]
    return program.module(), ExportCall(pytree.tree_flatten((args, kwargs))[1], constants)  # type: ignore[return-value]


def _captured(module: nn.Module, gm: fx.GraphModule, method: str) -> Captured:
    inputs: List[str] = []
    nodes: List[GraphNode] = []
    by_name: Dict[str, fx.Node] = {}
    outputs: List[str] = []
    modules = Modules(module)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs.append(node.name)
            by_name[node.name] = node
        elif node.op == "output":
            for leaf in pytree.tree_leaves(node.args[0], is_leaf=lambda x: isinstance(x, fx.Node)):
                if isinstance(leaf, fx.Node) and leaf.name not in outputs:
                    if leaf.op == "get_attr":
                        raise TraceError(f"the model returns its attribute {leaf.target!r} itself; return a copy")
                    outputs.append(leaf.name)
        elif node.op == "get_attr" or (node.op == "call_module" and node.target == "_guards_fn"):
            continue  # parameters and constants are referenced per stage; export's shape guards are dropped
        else:
            reads = tuple(dict.fromkeys(a.name for a in node.all_input_nodes if a.op != "get_attr"))
            leaf = node.op == "call_module"
            paths = modules.paths(node)
            nodes.append(GraphNode(node.name, node.target if leaf else (paths[-1] if paths else ""), reads,
                                   (node.name,), leaf, modules.unit(paths)))
            by_name[node.name] = node
    return Captured(module, gm, method, Graph(tuple(inputs), tuple(nodes), tuple(outputs)), by_name)


class Modules:
    """The model's module names, and its block lists: what a node's module stack means for the cut.

    A block list is an ``nn.ModuleList`` of two or more modules of one class of the model's own (not
    ``torch.nn`` built-ins) that together with the other block lists hold at least half of the
    parameters: a transformer's ``transformer.h`` or ``encoder.layer``. Where a model has block lists,
    ``balance=`` and ``stages=`` count blocks: each block is a unit, and what runs outside every block
    (embeddings, masks, final norm, head) joins the block before it (the first block, before any).
    """

    def __init__(self, module: nn.Module) -> None:
        named = dict(module.named_modules())
        self.names = set(named) - {""}
        total = sum(p.numel() for p in module.parameters())
        lists = [name for name, m in named.items() if isinstance(m, nn.ModuleList) and _repeated(m)]
        lists = [name for name in lists if not any(name.startswith(other + ".") for other in lists)]
        held = sum(p.numel() for name in lists for p in named[name].parameters())
        self.lists = set(lists) if lists and 2 * held >= total else set()

    def paths(self, node: fx.Node) -> List[str]:
        """Dotted paths of the model's modules whose forward is running when the node is made, outermost first."""
        stack = node.meta.get("nn_module_stack") or {}
        paths = [str(entry[0]).replace("L['self'].", "").replace("L__self__.", "") for entry in stack.values()]
        paths = [p for p in paths if p in self.names]  # tracer hooks (export's "_empty_nn_module_stack...") are not
        if node.op == "call_module" and (not paths or paths[-1] != node.target):
            paths.append(str(node.target))
        return paths

    def unit(self, paths: Sequence[str]) -> str:
        """The unit ``balance=`` counts: the outermost block, else (no block lists) the outermost module; "" joins."""
        if not self.lists:
            return paths[0] if paths else ""
        for path in paths:
            head, _, index = path.rpartition(".")
            if head in self.lists and index.isdigit():
                return path
        return ""


def _repeated(items: nn.ModuleList) -> bool:
    kinds = {type(m) for m in items}
    return len(items) >= 2 and len(kinds) == 1 and not next(iter(kinds)).__module__.startswith("torch.nn")


def stage_module(captured: Captured, reads: Sequence[str], nodes: Sequence[GraphNode],
                 sends: Sequence[str], j: int) -> fx.GraphModule:
    """An fx ``GraphModule`` running ``nodes``: takes ``reads`` (in order), returns the tuple ``sends``.

    Its submodules and parameters are the original model's objects (references, not copies).
    """
    graph = fx.Graph()
    env: Dict[str, fx.Node] = {name: graph.placeholder(name) for name in reads}
    for core in nodes:
        node = captured.nodes[core.name]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg.name not in env:
                env[arg.name] = graph.node_copy(arg)
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
    graph.output(tuple(env[name] for name in sends))
    stage = fx.GraphModule(captured.gm, graph, class_name=f"Stage{j}")
    _keep_non_persistent(stage, captured.module)
    return stage


def _keep_non_persistent(stage: nn.Module, model: nn.Module) -> None:
    """A buffer the model keeps out of its ``state_dict`` (BERT's ``position_ids``) stays out of the stage's."""
    for name, _ in list(stage.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        try:
            source = model.get_submodule(owner)
        except AttributeError:
            continue
        if leaf in source._non_persistent_buffers_set:
            stage.get_submodule(owner)._non_persistent_buffers_set.add(leaf)

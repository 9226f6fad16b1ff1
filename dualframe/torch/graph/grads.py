"""Never silently without gradients: a captured graph checked, once, for parameters its backward cannot reach.

torch.export records a custom ``torch.autograd.Function`` by running its forward under
``set_grad_enabled(False)`` (transformers' Reformer: every layer inside one), and the graph then has
no backward for what it computes: run split, the loss is right and the parameters get no gradient.
The check walks the graph back from its outputs through nodes that carry a gradient (floating
values, outside no-grad regions, not detached) to the parameters; it costs no compute. A parameter
the walk cannot reach but the graph reads is a suspect; only when there are suspects does the model
itself run once on the sample (forward and backward, buffers and random state restored) to see
whether they get a gradient unsplit; if they do, the split is refused, naming the module. A custom
Function that torch.export traces through with gradients on is recorded as its forward's operations,
whose derivative need not be the Function's backward (a straight-through estimator's is not): where
the trace applied one, the model and the graph both run once and every gradient must agree.
"""
from __future__ import annotations

from typing import Any, Dict, List, Set

import contextlib
from typing import Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from dualframe.errors import TraceError
from dualframe.torch.graph.call import Call

_STOPS = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh_copy.default}


def _no_grad_nodes(graph: fx.Graph) -> Set[fx.Node]:
    """Nodes made with gradients off: between ``_set_grad_enabled(False)`` and ``(True)``, or a no-grad region call."""
    off, found = False, set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            off = not node.args[0]
        elif off or (type(node.target).__name__ == "WrapWithSetGradEnabled" and node.args[0] is False):
            found.add(node)
    return found


def _carries_gradient(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if value is None:
        return True  # unknown: assume it does (the check may only miss, never refuse wrongly)
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    return any(t.is_floating_point() or t.is_complex() for t in leaves)


def unreached(gm: fx.GraphModule) -> Dict[str, torch.Tensor]:
    """Parameters (requiring grad) the graph reads but whose reads no gradient from an output reaches, by name."""
    no_grad = _no_grad_nodes(gm.graph)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    live: Set[fx.Node] = set()
    stack = list(output.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in live or node in no_grad or node.target in _STOPS or not _carries_gradient(node):
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    reached: Set[int] = set()
    read: Dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        tensor = _attribute(gm, str(node.target))
        if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
            read.setdefault(str(node.target), tensor)
            if node in live:
                reached.add(id(tensor))
    return {name: t for name, t in read.items() if id(t) not in reached}


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner), name, None)


@contextlib.contextmanager
def recording_functions() -> Iterator[List[str]]:
    """Note the custom ``torch.autograd.Function`` classes applied meanwhile (torch.export keeps no backward of theirs)."""
    seen: List[str] = []
    original = torch.autograd.Function.__dict__["apply"]  # the classmethod itself, to put back as it was

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith("torch.") and cls.__qualname__ not in seen:
            seen.append(cls.__qualname__)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


def check_gradients(module: torch.nn.Module, gm: fx.GraphModule, call: Call, graph_call: Call,
                    functions: Sequence[str] = ()) -> None:
    """Refuse a capture whose graph gives the model's parameters other gradients than the model does.

    Costs nothing unless the graph has suspects (``unreached``) or the trace ran custom autograd
    Functions: then the model, and for Functions the graph too, run once on the sample.

    Raises:
        TraceError: naming the modules whose parameters lose their gradient, and what to do.
    """
    suspects = unreached(gm)
    if not suspects and not functions:
        return
    names = {id(p): n for n, p in module.named_parameters()}
    params: List[torch.Tensor] = (list(suspects.values()) if not functions
                                  else [p for p in module.parameters() if p.requires_grad])
    wanted = _model_gradients(module, call, params)
    got = _model_gradients(gm, graph_call, params) if functions else [None] * len(params)
    lost = [names.get(id(p), "?") for p, w, g in zip(params, wanted, got)
            if w is not None and (g is None or not torch.allclose(g, w, rtol=1e-5, atol=1e-8))]
    if not lost:
        return  # e.g. used only under no_grad in the model too: no gradient either way
    owners = list(dict.fromkeys(name.rpartition(".")[0] for name in lost))
    named = dict(module.named_modules())
    where = ", ".join(f"{o or 'the model itself'} ({type(named[o]).__name__})" if o in named else o
                      for o in owners[:3])
    more = f" and {len(owners) - 3} more" if len(owners) > 3 else ""
    total = sum(1 for p in module.parameters() if p.requires_grad)
    why = (f"a custom torch.autograd.Function ({', '.join(functions)}), whose backward torch.export does not keep"
           if functions else "a no-grad region that the trace cannot see through")
    raise TraceError(
        f"{type(module).__name__} cannot be split: traced by torch.export, {len(lost)} of its {total} trainable "
        f"parameters would not get the gradient the model itself gives them (in {where}{more}). Their forward runs "
        f"inside {why}, so split they would train wrongly or not at all. Train this model unsplit (data "
        "parallelism), or write that code as plain differentiable torch")


def _model_gradients(module: torch.nn.Module, call: Call, params: List[torch.Tensor]) -> List[Any]:
    """Each of ``params``' gradient (or None) from one forward and backward of ``module`` on ``call``.

    ``backward()`` rather than ``autograd.grad``: a custom Function's backward may fill ``.grad`` itself
    (Reformer's does). Every parameter's ``.grad``, the buffers and the random state are restored after.
    """
    args, kwargs = call
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    grads = [(p, p.grad) for p in module.parameters()]
    try:
        for p, _ in grads:
            p.grad = None
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            out = module(*args, **kwargs)
            leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if leaves:
                torch.autograd.backward([t.sum() for t in leaves])
        return [p.grad for p in params]
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, grad in grads:
            p.grad = grad

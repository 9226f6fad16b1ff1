"""A stage's backward in two passes, for zero-bubble schedules: the input's gradient now, the weights' later.

A zero-bubble schedule (``"zb-h1"``) runs ``B i``, the gradient of the stage's input that the previous
stage waits for, as soon as it can, and ``W i``, the gradient of the stage's weights, later in ticks
that would otherwise be idle. In torch, ``B i`` is ``torch.autograd.grad`` of the stage's output with
respect to its input *and* to the output of every module that owns parameters (recorded by a
forward hook as a ``GradientEdge``, so an in-place op after the module does not move it), keeping
the graph; autograd then skips every weight product. ``W i`` computes, for a plain ``nn.Linear``, its
weights' gradient as the products autograd would (``grad_out.T @ input``, ``grad_out.sum(0)``) from the
input the hook kept, without walking the graph again, added straight into ``.grad`` where no hook
watches the parameter; for any other module, the backward from its output (with the gradient B found)
to its own parameters only. Wherever a hook watches a parameter (``DistributedOptimizer``'s, ZeRO's), its
gradient goes into ``.grad`` through its own accumulator node (``AccumulateGrad``), so the hook fires as
after ``loss.backward()``. Parameters used outside a module call (a graph's ``get_attr``) get their
gradient in ``B i`` already.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, cast

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge


class Call(NamedTuple):
    """One call of a module that owns parameters: its outputs' edges and, for a plain ``nn.Linear``, its input."""

    module: nn.Module
    edges: List[GradientEdge]
    #: A plain ``nn.Linear``'s input and its version then (W computes its products from it), else None.
    linear_input: Optional[Tuple[torch.Tensor, int]]


#: What one micro-batch's forward recorded: each call of a module that owns parameters.
Recorded = List[Call]


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class SplitBackward:
    """Records a stage's forward per micro-batch and runs its backward as B (input) then W (weights).

    Example:
        >>> split = SplitBackward(stage)                                        # doctest: +SKIP
        >>> with split.recording(i): y = stage(x)                              # doctest: +SKIP
        >>> (grad_x,) = split.input_pass(i, [y], [grad_y], [x])                # doctest: +SKIP
        >>> split.weight_pass(i)  # later: the parameters' .grad now hold it    # doctest: +SKIP
    """

    def __init__(self, stage: nn.Module) -> None:
        self.parameters = [p for p in stage.parameters() if p.requires_grad]
        owners = [m for m in stage.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        # Hooks stay registered for the stage's life; they record only inside ``recording``.
        self._handles = [m.register_forward_hook(self._hook) for m in owners]
        self._recording: Optional[Recorded] = None
        self._recorded: Dict[int, Recorded] = {}
        self._pending: Dict[int, Tuple[Recorded, Sequence[Optional[torch.Tensor]]]] = {}

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._recording is None or not torch.is_grad_enabled():
            return
        edges = [get_gradient_edge(t) for t in _tensors(output) if t.requires_grad]
        if edges:
            self._recording.append(Call(module, edges, _linear_input(module, args, output)))

    @contextlib.contextmanager
    def recording(self, i: int) -> Iterator[None]:
        """Record micro-batch i's forward run inside this block (the modules owning parameters it calls)."""
        self._recording = []
        try:
            yield
            self._recorded[i] = self._recording
        finally:
            self._recording = None

    def input_pass(self, i: int, roots: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """B i: the gradients of ``inputs`` from ``roots`` (with ``grads``), keeping what ``weight_pass`` needs.

        Returns one gradient per input (None where it has none).
        """
        recorded = self._recorded.pop(i)
        covered = {id(p) for call in recorded for p in call.module.parameters(recurse=False)}
        rest = [p for p in self.parameters if id(p) not in covered]
        edges = [edge for call in recorded for edge in call.edges]
        wanted: List[Any] = [*inputs, *edges, *rest]
        found: Sequence[Optional[torch.Tensor]] = [None] * len(wanted)
        if wanted and any(r.requires_grad for r in roots):
            found = torch.autograd.grad(list(roots), wanted, list(grads), retain_graph=bool(edges), allow_unused=True)
        for p, g in zip(rest, found[len(inputs) + len(edges):]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self._pending[i] = (recorded, found[len(inputs):len(inputs) + len(edges)])
        return list(found[:len(inputs)])

    def weight_pass(self, i: int) -> None:
        """W i: each recorded module's parameters' gradient from its output's, accumulated into ``.grad``."""
        recorded, grads = self._pending.pop(i)
        roots: List[GradientEdge] = []
        products: List[torch.Tensor] = []
        k = 0
        for call in recorded:
            pairs = [(e, g) for e, g in zip(call.edges, grads[k:k + len(call.edges)]) if g is not None]
            k += len(call.edges)
            if not pairs:
                continue
            if call.linear_input is not None:  # added into .grad now, or left for autograd (a hook watches it)
                for edge, product in linear_weight_grads(cast(nn.Linear, call.module), call.linear_input, pairs[0][1]):
                    roots.append(edge)
                    products.append(product)
                continue
            params = [p for p in call.module.parameters(recurse=False) if p.requires_grad]
            if params:
                # retain_graph: a module nested in another is walked again from the outer one's output;
                # the graph goes when this micro-batch's records are dropped, at the end of this pass.
                torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs], inputs=params,  # type: ignore[arg-type]
                                        retain_graph=True)
        if roots:  # one pass of the engine: each product to its parameter's accumulator and its hooks
            torch.autograd.backward(roots, products)  # type: ignore[arg-type]

    def close(self) -> None:
        """Remove the forward hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _linear_input(module: nn.Module, args: Any, output: Any) -> Optional[Tuple[torch.Tensor, int]]:
    """A plain ``nn.Linear`` call's input and its version, where W may compute the products from it; else None.

    Not for a subclass with its own forward, a parametrized weight, autocast (the products' dtype would
    differ from autograd's) or an input of another dtype than the weight's.
    """
    if type(module).forward is not nn.Linear.forward or len(args) != 1 or not isinstance(output, torch.Tensor):
        return None
    x, weight = args[0], module.weight
    if (type(x) is not torch.Tensor or not isinstance(weight, nn.Parameter) or x.dtype != weight.dtype
            or torch.is_autocast_enabled(x.device.type)):
        return None
    return x, x._version


def linear_weight_grads(module: nn.Linear, kept: Tuple[torch.Tensor, int],
                        grad_out: torch.Tensor) -> List[Tuple[GradientEdge, torch.Tensor]]:
    """An ``nn.Linear``'s weight and bias gradients from its kept input and its output's gradient.

    The products ``linear``'s backward computes (``grad_out.T @ input``, ``grad_out.sum(0)`` over every
    row). Where nothing watches a parameter's gradient (``_unwatched``), the product is added into its
    ``.grad`` as it is computed (``addmm_``: one pass, where autograd adds a separate product afterwards);
    the others are returned with their accumulator's edge, for autograd to accumulate and fire their hooks.

    Raises:
        RuntimeError: the input was changed in place after the call (its backward would be wrong), as autograd's.
    """
    x, version = kept
    if x._version != version:
        raise RuntimeError(f"the input of {type(module).__name__} was modified by an inplace operation after its "
                           f"forward (version {version}, now {x._version}); its weights' gradient needs it unchanged")
    through: List[Tuple[GradientEdge, torch.Tensor]] = []
    with torch.no_grad():
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if module.weight.requires_grad:
            rows = x.reshape(-1, x.shape[-1])
            _accumulate(module.weight, lambda: g.t().mm(rows), lambda grad: grad.addmm_(g.t(), rows), through)
        if module.bias is not None and module.bias.requires_grad:
            total = g.sum(0)
            _accumulate(module.bias, lambda: total, lambda grad: grad.add_(total), through)
    return through


def _accumulate(p: torch.Tensor, product: Callable[[], torch.Tensor], add_into: Callable[[torch.Tensor], Any],
                through: List[Tuple[GradientEdge, torch.Tensor]]) -> None:
    """``p.grad`` set to ``product()`` or ``add_into(p.grad)``; where a hook watches ``p``, its edge and product
    appended to ``through`` instead (autograd accumulates them)."""
    if not _unwatched(p):
        through.append((get_gradient_edge(p), product()))
    elif p.grad is None:
        p.grad = product()
    else:
        add_into(p.grad)


def _unwatched(p: torch.Tensor) -> bool:
    """Whether W may write ``p.grad`` itself, as autograd's accumulator would: no hook on ``p``'s gradient
    (``register_hook``, ``register_post_accumulate_grad_hook``: ``DistributedOptimizer``'s and ZeRO's), and
    ``.grad`` absent (``p`` contiguous) or a dense tensor of ``p``'s dtype, device and shape."""
    if p._backward_hooks or p._post_accumulate_grad_hooks:
        return False
    grad = p.grad
    if grad is None:
        return p.is_contiguous()
    return (type(grad) is torch.Tensor and grad.layout == torch.strided and grad.dtype == p.dtype
            and grad.device == p.device and grad.shape == p.shape)

"""A stage's backward in two passes, for zero-bubble schedules: the input's gradient now, the weights' later.

A zero-bubble schedule (``"zb-h1"``) runs ``B i``, the gradient of the stage's input that the previous
stage waits for, as soon as it can, and ``W i``, the gradient of the stage's weights, later in ticks
that would otherwise be idle. In torch, ``B i`` is ``torch.autograd.grad`` of the stage's output with
respect to its input *and* to the output of every module that owns parameters (recorded by a
forward hook as a ``GradientEdge``, so an in-place op after the module does not move it), keeping
the graph; autograd then skips every weight product. ``W i`` runs, per such module, the backward
from its output (with the gradient B found) to its own parameters only: the weight products and
nothing else, accumulated into ``.grad`` by autograd itself (so ``DistributedOptimizer``'s hooks fire as
after ``loss.backward()``). Parameters used outside a module call (a graph's ``get_attr``) get their
gradient in ``B i`` already.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

#: What one micro-batch's forward recorded: each module that owns parameters with its outputs' edges.
Recorded = List[Tuple[nn.Module, List[GradientEdge]]]


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
            self._recording.append((module, edges))

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
        covered = {id(p) for module, _ in recorded for p in module.parameters(recurse=False)}
        rest = [p for p in self.parameters if id(p) not in covered]
        edges = [edge for _, module_edges in recorded for edge in module_edges]
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
        k = 0
        for module, edges in recorded:
            pairs = [(e, g) for e, g in zip(edges, grads[k:k + len(edges)]) if g is not None]
            k += len(edges)
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if pairs and params:
                # retain_graph: a module nested in another is walked again from the outer one's output;
                # the graph goes when this micro-batch's records are dropped, at the end of this pass.
                torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs], inputs=params,  # type: ignore[arg-type]
                                        retain_graph=True)

    def close(self) -> None:
        """Remove the forward hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

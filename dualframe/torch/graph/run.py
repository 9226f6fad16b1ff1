"""One step of a split torch model in one process, cell by cell over the core's one-process schedule.

A model cut as a graph and a chain of layer groups (``graph.chain``: edges (j - 1, j)) run alike. Every cell
(micro-batch i, stage j) is its own small autograd graph: it reads the values ``reads[j]`` (model inputs, or
values sent by the stages that produced them), each detached and moved to stage j's device, and produces
the tuple ``sends[j]``. Forward runs the schedule's clock ticks, backward the mirrored ones, the cells of a
tick in threads, one per device (cells sharing a device run one after another in the calling thread). A
cell's backward sums, for each value it sent, the gradients coming back from every stage that read it (and
from the caller for a model output), and hands the gradients of its reads back to their producers. Values
are pytrees (a tensor, a tuple of tensors, a dict); non-tensor leaves pass as they are.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dualframe.errors import ChunksError
from dualframe.pipeline.executor import RecordFn, run_ticks
from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.schedule import one_process_ticks
from dualframe.pipeline.split import Split
from dualframe.torch.split.rng import checkpointed

Grads = List[Optional[torch.Tensor]]  # one per tensor leaf of a value


def tensor_leaves(value: Any) -> List[torch.Tensor]:
    """The tensors of a pytree value, in flattening order."""
    if isinstance(value, torch.Tensor):  # the common case, without pytree's walk
        return [value]
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def split_inputs(values: Dict[str, Any], sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """Each input value cut into micro-batches along dimension 0 (0-d tensors and non-tensors repeated).

    Raises:
        ChunksError: an input tensor whose first dimension is not the batch's, naming it.
    """
    parts: List[Dict[str, Any]] = [{} for _ in sizes]
    for name, value in values.items():
        if isinstance(value, torch.Tensor):  # the common case, without pytree's walk
            for part, piece in zip(parts, _split_leaf(value, name, sizes)):
                part[name] = piece
            continue
        flat, spec = pytree.tree_flatten(value)
        pieces = [_split_leaf(leaf, name, sizes) for leaf in flat]
        for i, part in enumerate(parts):
            part[name] = pytree.tree_unflatten([p[i] for p in pieces], spec)
    return parts


def _split_leaf(leaf: Any, name: str, sizes: Sequence[int]) -> Sequence[Any]:
    """One input leaf cut into micro-batches (0-d tensors and non-tensors repeated)."""
    if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
        return [leaf] * len(sizes)
    if leaf.shape[0] != sum(sizes):
        raise ChunksError(f"every input tensor must have the batch in dimension 0 (input {name!r}: "
                          f"shape {list(leaf.shape)}, batch: {sum(sizes)})")
    return torch.split(leaf, list(sizes))


def batch_size(values: Dict[str, Any]) -> int:
    """Rows of the first input tensor with a dimension (the batch every input must share)."""
    for value in values.values():
        for leaf in tensor_leaves(value):
            if leaf.dim() > 0:
                return int(leaf.shape[0])
    raise ChunksError("the model's inputs hold no tensor with a batch dimension to cut into micro-batches")


def _joined(pieces: Sequence[Any], name: str, weights: Optional[Sequence[float]] = None) -> Any:
    """Micro-batch pieces of one value joined along dimension 0; with ``weights`` (the model's own loss,
    a mean), 0-d pieces joined as their mean weighted by the micro-batches' shares of rows."""
    if isinstance(pieces[0], torch.Tensor) and pieces[0].dim() > 0:  # the common case, without pytree's walk
        return pieces[0].detach() if len(pieces) == 1 else torch.cat([piece.detach() for piece in pieces])
    flats = [pytree.tree_flatten(piece) for piece in pieces]
    spec = flats[0][1]
    joined = []
    for k, leaf in enumerate(flats[0][0]):
        if not isinstance(leaf, torch.Tensor):
            joined.append(leaf)
        elif len(pieces) == 1:
            joined.append(leaf.detach())
        elif leaf.dim() == 0 and weights is not None:
            joined.append(sum(f[0][k].detach() * w for f, w in zip(flats, weights)))
        elif leaf.dim() == 0:
            raise ChunksError(f"output {name!r} is a 0-d tensor, which micro-batches cannot be joined into; "
                              "return per-row values (or use chunks=1)")
        else:
            joined.append(torch.cat([f[0][k].detach() for f in flats]))
    return pytree.tree_unflatten(joined, spec)


def _take(leaf: Any, device: torch.device, grad: bool) -> Any:
    """A value's tensor leaf as a cell reads it: detached, on the cell's device, requiring grad where it did."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    x = leaf.detach().to(device, non_blocking=True)
    if grad and leaf.requires_grad:
        x.requires_grad_()
    return x


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for the work a stage thread enqueues (a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class StepRun:
    """One step of a split model: the micro-batches, what each cell read and sent, and the gradients.

    Args:
        stages: stage j's module, taking the values ``split.reads[j]`` and returning the tuple ``split.sends[j]``.
        devices: stage j's device.
        plan: the split (schedule, stages, which micro-batches are checkpointed).
        split: the graph split (a chain's: ``graph.chain.ChainPart``).
        parts: each micro-batch's input values by name.
        params: stage j's parameters (whose gradients the step returns).
        shapes: filled with each sent value's tensor shapes and dtypes (micro-batch 0), if given.
        loss: the output value that is the model's own loss (a mean over rows), if any.
        record, lanes: ``run_ticks``' timeline recorder and lanes (cells of a tick in one lane share a thread).
        masters: a copy's id -> the model's tensor it stands for (``split.devices``).

    Example:
        >>> run = StepRun(stages, devices, plan, ChainPart(2).split, [{"x0": x}], params)   # doctest: +SKIP
        >>> outputs = run.forward(grad=True)                                                  # doctest: +SKIP
        >>> input_grads, param_grads = run.backward({"x2": [torch.ones_like(outputs["x2"])]}) # doctest: +SKIP
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device], plan: Split,
                 split: GraphSplit, parts: Sequence[Dict[str, Any]], params: Sequence[Sequence[nn.Parameter]],
                 shapes: Optional[Dict[str, Any]] = None, loss: Optional[str] = None,
                 record: Optional[RecordFn] = None, lanes: Optional[Sequence[Hashable]] = None,
                 masters: Optional[Mapping[int, torch.Tensor]] = None) -> None:
        self.stages, self.devices, self.plan, self.split, self.parts = stages, devices, plan, split, list(parts)
        self.params, self.shapes, self.loss = params, shapes, loss
        self.record, self.lanes, self.masters = record, lanes, masters or {}
        self.param_grads: List[List[Optional[torch.Tensor]]] = [[None] * len(p) for p in params]
        self.grad = False
        self.cell_reads: Dict[Tuple[int, int], List[Any]] = {}
        self.cell_sends: Dict[Tuple[int, int], Tuple[Any, ...]] = {}
        self.read_grads: Dict[Tuple[int, int], Dict[str, Grads]] = {}
        self.output_grads: List[Dict[str, Grads]] = []
        self.input_grads: List[Dict[str, Grads]] = []
        self.rows = [batch_size(part) for part in self.parts]
        # value name -> the stages that read it (its consumers but the caller, ``split.stages``)
        self.readers = {name: [c for c in js if c < split.stages] for name, js in split.consumers.items()}
        # value name -> (its producer, its place in the producer's sends); producer -1: a model input
        self.slots = {name: (-1, -1) for name in split.graph.inputs}
        self.slots.update({name: (j, k) for j, sent in enumerate(split.sends) for k, name in enumerate(sent)})

    def forward(self, grad: bool) -> Dict[str, Any]:
        """Run every forward cell by clock tick; return each model output joined over micro-batches."""
        self.grad = grad
        ticks = one_process_ticks(self.plan.schedule, len(self.parts), self.plan.stages, "F")
        run_ticks(ticks, self._forward_cell, self.plan.stages, "F", record=self.record, lanes=self.lanes)
        return self._result()

    def backward(self, grad_outputs: Dict[str, Grads]) -> Tuple[Dict[str, Grads], List[Optional[torch.Tensor]]]:
        """Run every backward cell by mirrored clock tick; return (each input's gradients, parameter gradients)."""
        self._start_backward(grad_outputs)
        ticks = one_process_ticks(self.plan.schedule, len(self.parts), self.plan.stages, "B")
        run_ticks(ticks, self._backward_cell, self.plan.stages, "B", record=self.record, lanes=self.lanes)
        return self._input_gradient(), self._param_gradients()

    def _param_gradients(self) -> List[Optional[torch.Tensor]]:
        """Every parameter's gradient summed over micro-batches (and over the stages sharing it or its copies)."""
        summed: Dict[int, Optional[torch.Tensor]] = {}
        for stage, grads in zip(self.params, self.param_grads):
            for p, g in zip(stage, grads):
                key = id(self.masters.get(id(p), p))
                old = summed.get(key)
                summed[key] = g if old is None else (old if g is None else old + g.to(old.device))
        return [summed.get(id(p)) for p in unique_params(self.params, self.masters)]

    def _accumulate(self, j: int, found: Sequence[Optional[torch.Tensor]]) -> None:
        """Add stage j's parameter gradients of one micro-batch (``found``: one per trainable parameter) into the step's."""
        trainable = iter(found)
        for index, p in enumerate(self.params[j]):
            if p.requires_grad:
                g = next(trainable)
                if g is not None:
                    old = self.param_grads[j][index]
                    if old is None:
                        self.param_grads[j][index] = g  # a fresh tensor from autograd.grad: ours to add into
                    else:
                        old.add_(g)

    def _value(self, i: int, name: str) -> Any:
        producer, slot = self.slots[name]
        if producer < 0:
            return self.parts[i][name]
        return self.cell_sends[(i, producer)][slot]

    def _forward_cell(self, i: int, j: int) -> None:
        device, grad = self.devices[j], self.grad
        with device_scope(device), torch.set_grad_enabled(grad):
            reads = [_take(v, device, grad) if isinstance(v, torch.Tensor) else
                     pytree.tree_map(functools.partial(_take, device=device, grad=grad), v)
                     for v in (self._value(i, name) for name in self.split.reads[j])]
            if grad and self.plan.checkpointed(i):
                sends = checkpointed(self.stages[j], device, *reads)
            else:
                sends = self.stages[j](*reads)
        self.cell_reads[(i, j)], self.cell_sends[(i, j)] = reads, tuple(sends)
        if i == 0 and self.shapes is not None:
            for name, value in zip(self.split.sends[j], sends):
                self.shapes[name] = [(tuple(t.shape), t.dtype) for t in tensor_leaves(value)]

    def _result(self) -> Dict[str, Any]:
        """Each model output joined over micro-batches (on its producer's device)."""
        weights = self._weights()
        return {name: _joined([self._value(i, name) for i in range(len(self.parts))], name,
                              weights if name == self.loss else None)
                for name in self.split.graph.outputs}

    def _weights(self) -> List[float]:
        """Each micro-batch's share of the rows (how the model's own loss joins)."""
        return [r / sum(self.rows) for r in self.rows]

    def _start_backward(self, grad_outputs: Dict[str, Grads]) -> None:
        """Cut each output's gradients into micro-batches."""
        self.output_grads = [{} for _ in self.parts]
        for name, grads in grad_outputs.items():
            pieces = [g.split(self.rows) if g is not None and g.dim() > 0 else self._repeated(g, name) for g in grads]
            for i in range(len(self.parts)):
                self.output_grads[i][name] = [p[i] for p in pieces]
        self.input_grads = [{} for _ in self.parts]

    def _repeated(self, grad: Optional[torch.Tensor], name: str) -> List[Optional[torch.Tensor]]:
        """A 0-d output's gradient for each micro-batch: the same, or its share where the output is the loss."""
        if grad is None or name != self.loss or len(self.parts) == 1:
            return [grad] * len(self.parts)
        return [grad * w for w in self._weights()]

    def _upstream(self, i: int, j: int, name: str, count: int, device: torch.device) -> Grads:
        """The gradient of value ``name`` of cell (i, j): summed over its readers and the caller."""
        total: Grads = [None] * count
        sources = [self.read_grads[(i, c)].pop(name) for c in self.readers[name]]
        if name in self.output_grads[i]:
            sources.append(self.output_grads[i][name])
        for grads in sources:
            for k, g in enumerate(grads):
                if g is not None:
                    g = g.to(device, non_blocking=True)
                    total[k] = g if total[k] is None else total[k] + g  # type: ignore[operator]
        return total

    def _backward_cell(self, i: int, j: int) -> None:
        device = self.devices[j]
        reads, sends = self.cell_reads.pop((i, j)), self.cell_sends.pop((i, j))
        outs: List[torch.Tensor] = []
        grads: List[torch.Tensor] = []
        with device_scope(device):
            for name, value in zip(self.split.sends[j], sends):
                leaves = tensor_leaves(value)
                for leaf, g in zip(leaves, self._upstream(i, j, name, len(leaves), device)):
                    if g is not None and leaf.requires_grad:
                        outs.append(leaf)
                        grads.append(g)
            read_leaves = [tensor_leaves(value) for value in reads]
            wanted = [t for leaves in read_leaves for t in leaves if t.requires_grad]
            trainable: List[torch.Tensor] = [p for p in self.params[j] if p.requires_grad]
            found = (torch.autograd.grad(outs, wanted + trainable, grads, allow_unused=True)
                     if outs and (wanted or trainable) else [None] * (len(wanted) + len(trainable)))
        it = iter(found[:len(wanted)])
        self.read_grads[(i, j)] = {}
        for name, leaves in zip(self.split.reads[j], read_leaves):
            grads_of = [next(it) if t.requires_grad else None for t in leaves]
            if self.split.producer[name] < 0:
                self._add_input_grad(i, name, grads_of)
            else:
                self.read_grads[(i, j)][name] = grads_of
        self._accumulate(j, found[len(wanted):])

    def _add_input_grad(self, i: int, name: str, grads: Grads) -> None:
        old = self.input_grads[i].get(name)
        if old is None:
            self.input_grads[i][name] = list(grads)
            return
        for k, g in enumerate(grads):
            held = old[k]
            if g is not None:
                old[k] = g if held is None else held + g.to(held.device)

    def _input_gradient(self) -> Dict[str, Grads]:
        """Per model input, its tensor leaves' gradients joined over micro-batches (None: no gradient)."""
        joined: Dict[str, Grads] = {}
        for name in self.split.graph.inputs:
            count = len(tensor_leaves(self.parts[0][name]))  # type: ignore[index]
            joined[name] = []
            for k in range(count):
                pieces = [self.input_grads[i].get(name, [None] * count)[k] for i in range(len(self.parts))]
                whole: Optional[torch.Tensor] = None
                if all(p is not None for p in pieces):  # a 0-d input was repeated: its gradients add up
                    whole = pieces[0] if len(pieces) == 1 else (
                        torch.stack(pieces).sum(0) if pieces[0].dim() == 0 else torch.cat(pieces))  # type: ignore
                joined[name].append(whole)
        return joined


def unique_params(params: Sequence[Sequence[nn.Parameter]],
                  masters: Optional[Mapping[int, Any]] = None) -> List[nn.Parameter]:
    """Every stage's parameters in order, each once (a parameter may be shared by two stages; a copy on
    another device stands for its master, ``masters``: id of a copy -> the model's parameter)."""
    seen: Dict[int, nn.Parameter] = {}
    for stage in params:
        for p in stage:
            p = (masters or {}).get(id(p), p)
            seen.setdefault(id(p), p)
    return list(seen.values())

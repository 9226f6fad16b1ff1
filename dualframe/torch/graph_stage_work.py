"""One process stage of a graph split in torch: one packed byte message per edge (the core's GraphStageWork).

A forward message from stage p to stage c holds every value c reads from p (``edge_values``); the
backward message holds their gradients in the same layout (zeros where a value has none, e.g. a
padding mask), so the receiver of a forward message knows the size of the gradient to expect. A
message is a flat ``uint8`` tensor: an int64 header (count, then per tensor its dtype code, ndim
and dims) followed by each tensor's bytes, padded to 8.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from dualframe.errors import StrategyError
from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.graph_walk import edge_values, stage_edges
from dualframe.pipeline.link import MAX_DIMS
from dualframe.torch.graph import Captured
from dualframe.torch.pipeline_transport import DTYPES, dtype_code
from dualframe.torch.pipeline_work import ActivationMeter
from dualframe.torch.split_backward import SplitBackward

_FIELDS = 2 + MAX_DIMS  # per tensor: dtype code, ndim, dims


def pack(tensors: Sequence[Any], names: Sequence[str], device: torch.device) -> torch.Tensor:
    """The tensors as one flat uint8 message (see the module docstring).

    Raises:
        StrategyError: a value that is not a tensor (a shape, a tuple): cut elsewhere.
    """
    header = [len(tensors)]
    parts = []
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise StrategyError(f"value {name!r} crosses between process stages but is a {type(t).__name__}, not a "
                                "tensor; choose a cut where only tensors cross")
        if t.dim() > MAX_DIMS:
            raise StrategyError(f"value {name!r} has {t.dim()} dimensions; a message carries at most {MAX_DIMS}")
        header += [dtype_code(t.dtype), t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        parts += [data, torch.zeros((-data.numel()) % 8, dtype=torch.uint8, device=device)]
    head = torch.tensor(header, dtype=torch.int64).view(torch.uint8).to(device)
    return torch.cat([head, *parts])


def unpack(message: torch.Tensor) -> List[torch.Tensor]:
    """The tensors of a ``pack`` message (fresh tensors on the message's device)."""
    count = int(message[:8].view(torch.int64)[0])
    header = message[:8 * (1 + _FIELDS * count)].clone().view(torch.int64).tolist()
    offset, out = 8 * (1 + _FIELDS * count), []
    for k in range(count):
        code, ndim, *dims = header[1 + _FIELDS * k:1 + _FIELDS * (k + 1)]
        dtype, shape = DTYPES[code], tuple(dims[:ndim])
        size = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            size *= d
        out.append(message[offset:offset + size].clone().view(dtype).reshape(shape))
        offset += size + (-size) % 8
    return out


class TorchGraphStageWork:
    """Forward and backward of stage j of a graph split on micro-batch i, keeping what backward needs.

    The last stage gathers the model's outputs (its own and those sent to it), rebuilds the model's
    return value and turns it into the loss weighted by the micro-batch's share of rows.
    """

    def __init__(self, stage: nn.Module, split: GraphSplit, j: int, captured: Captured, device: torch.device,
                 loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]], targets: List[torch.Tensor],
                 weights: List[float], meter: ActivationMeter, split_backward: Optional[SplitBackward] = None) -> None:
        self.stage, self.split, self.j, self.captured, self.device = stage, split, j, captured, device
        self.split_backward = split_backward
        self.loss_fn, self.targets, self.weights, self.meter = loss_fn, targets, weights, meter
        self.last = j == split.stages - 1
        edges = stage_edges(split, j)
        self.incoming = {p: edge_values(split, p, j) for p in edges.sources}
        self.outgoing = {c: edge_values(split, j, c) for c in edges.targets}
        self._saved: Dict[int, Tuple[Dict[int, List[torch.Tensor]], Dict[int, List[Any]], Any]] = {}
        self.outputs: List[Dict[str, Any]] = []
        self.loss_sum = 0.0

    def forward(self, i: int, received: Mapping[int, Any]) -> Dict[int, torch.Tensor]:
        training = self.loss_fn is not None
        values: Dict[str, Any] = dict(received.get(-1, {}))
        held: Dict[int, List[torch.Tensor]] = {}
        for p, names in self.incoming.items():
            tensors = [t.requires_grad_() if training and t.is_floating_point() else t for t in unpack(received[p])]
            values.update(zip(names, tensors))
            held[p] = tensors
        args = [values[v] for v in self.split.reads[self.j]]
        if training and self.split_backward is not None:
            with self.split_backward.recording(i):
                sends = self.stage(*args)
        else:
            sends = self.stage(*args)
        values.update(zip(self.split.sends[self.j], sends))
        messages = {c: pack([values[v] for v in names], names, self.device) for c, names in self.outgoing.items()}
        if self.last:
            outputs = {v: values[v] for v in self.split.graph.outputs}
            if not training:
                self.outputs.append({v: t.detach() if isinstance(t, torch.Tensor) else t for v, t in outputs.items()})
                return messages
            assert self.loss_fn is not None
            loss = self.loss_fn(self.captured.unflatten(outputs), self.targets[i]) * self.weights[i]
            self.loss_sum += float(loss.detach())
            self._saved[i] = (held, {}, loss)
        elif training:
            self._saved[i] = (held, {c: [values[v] for v in names] for c, names in self.outgoing.items()}, None)
        return messages

    def backward(self, i: int, grads: Mapping[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        held, sent, loss = self._saved.pop(i)
        roots, upstream = ([loss], [None]) if loss is not None else self._roots(sent, grads)
        if self.split_backward is not None:
            inputs = [t for tensors in held.values() for t in tensors if t.requires_grad]
            found = iter(self.split_backward.input_pass(i, roots, upstream, inputs))
            back = {p: [next(found) if t.requires_grad else None for t in tensors] for p, tensors in held.items()}
        else:
            if roots:
                torch.autograd.backward(roots, upstream)  # a value sent to two stages: both gradients add up
            back = {p: [t.grad for t in tensors] for p, tensors in held.items()}
        return {p: pack([g if g is not None else torch.zeros_like(t) for t, g in zip(held[p], gs)], self.incoming[p],
                        self.device)
                for p, gs in back.items()}

    def weight(self, i: int) -> None:
        assert self.split_backward is not None, "W actions come with a split backward"
        self.split_backward.weight_pass(i)

    @staticmethod
    def _roots(sent: Mapping[int, List[Any]], grads: Mapping[int, torch.Tensor]) -> Tuple[List[Any], List[Any]]:
        roots, upstream = [], []
        for c, message in grads.items():
            for t, g in zip(sent[c], unpack(message)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    roots.append(t)
                    upstream.append(g.to(t.device))
        return roots, upstream

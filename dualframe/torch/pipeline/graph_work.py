"""One process stage of a graph split in torch: one packed byte message per edge (the core's GraphStageWork).

Each message holds what one edge carries, in ``dualframe.pipeline.message``'s layout (an int64 header,
each tensor's bytes, a JSON tail for values that are not one tensor: a traced size (torch.export's
``sym_size_int``), a shape, a flag or None); this module converts torch tensors to and from those bytes.
An edge between two stages of one rank (ZB-V's turn) carries the values themselves (``handed``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from dualframe.errors import StrategyError
from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.graph_walk import edge_values, stage_edges
from dualframe.pipeline import message
from dualframe.torch.graph.capture import Captured
from dualframe.torch.graph.chain import ChainStage
from dualframe.torch.graph.run import tensor_leaves
from dualframe.torch.pipeline.link import DTYPES, dtype_code
from dualframe.torch.pipeline.activation_meter import ActivationMeter
from dualframe.torch.pipeline.backward import SplitBackward
from dualframe.torch.pipeline.recompute import StageRecompute

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)  # a traced size: a number at run time


class _TorchLeaves:
    """torch's non-tensor leaves of a message: dtypes, devices and ``torch.Size`` (``dualframe.pipeline.message``)."""

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def encode(self, value: Any) -> Optional[Dict[str, Any]]:
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).replace("torch.", "")}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, torch.Size):
            return {"size": [int(d) for d in value]}
        return None

    def decode(self, kind: str, body: Any) -> Any:
        return getattr(torch, body) if kind == "dtype" else torch.device(body) if kind == "device" else torch.Size(body)


_LEAVES = _TorchLeaves()


def _leaf(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, torch.dtype, torch.device) + _SYMBOLIC)


def unsendable(value: Any) -> Optional[str]:
    """The type name of the first part of ``value`` that a message cannot carry; None where all of it can.

    A message carries tensors, numbers, bools, None, strings, dtypes, devices, and tuples, lists and
    dicts (string keys) of them: a traced size (torch.export's ``sym_size_int``), a shape or a flag.
    """
    return message.unsendable(value, _leaf)


def check_crossing(captured: Captured, split: GraphSplit) -> None:
    """Refuse, before any message, a cut where a value a message cannot carry crosses (torch.export knows types).

    Raises:
        StrategyError: naming the value, the module that makes it and the stage that reads it.
    """
    if captured.method != "export":
        return  # fx records no types: ``pack`` checks each value as it is sent
    for j in range(split.stages - 1):
        for name in split.crossing(j):
            node = captured.nodes.get(name)
            bad = unsendable(node.meta.get("val")) if node is not None and "val" in node.meta else None
            if bad is not None:
                core = next(n for n in split.graph.nodes if n.name == name)
                readers = [f"stage {c}" for c in split.consumers.get(name, ()) if c > j]
                raise StrategyError(
                    f"value {name!r} (made in {core.scope or 'the model itself'!r}, read by {', '.join(readers)}) "
                    f"crosses between process stages and holds a {bad}, which a message cannot carry (tensors, "
                    "numbers, bools, None, strings and tuples, lists and dicts of them can); cut before it is made "
                    f"or after its last use (split_points={list(split.split_points)})")


def _with_tensors(values: Sequence[Any], tensors: Sequence[torch.Tensor]) -> List[Any]:
    """``values`` with their tensor leaves replaced, in order, by ``tensors`` (a gradient message's layout)."""
    it = iter(tensors)
    return [next(it) if isinstance(v, torch.Tensor) else
            pytree.tree_map(lambda x: next(it) if isinstance(x, torch.Tensor) else x, v) for v in values]


def pack(values: Sequence[Any], names: Sequence[str], device: torch.device) -> torch.Tensor:
    """The values as one flat uint8 message (``dualframe.pipeline.message``'s layout).

    Raises:
        StrategyError: a value holding something a message cannot carry (see ``unsendable``), naming it.
    """
    if not all(isinstance(v, torch.Tensor) for v in values):
        message.check_sendable(values, names, _leaf)
    tensors, tail = message.structure(values, _LEAVES)
    named = [name for name, v in zip(names, values) for _ in tensor_leaves(v)]  # a value may hold several tensors
    head = message.header([(name, dtype_code(t.dtype), tuple(t.shape)) for name, t in zip(named, tensors)], len(tail))
    parts = [torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)]
    for t in tensors:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        parts += [data, torch.zeros(message.padding(data.numel()), dtype=torch.uint8, device=device)]
    if tail:
        parts.append(torch.frombuffer(bytearray(tail), dtype=torch.uint8).to(device))
    return torch.cat(parts)


def unpack(raw: torch.Tensor) -> List[Any]:
    """The values of a ``pack`` message: views of its bytes (each receive fills a fresh buffer), copies where
    the message does not start at a multiple of 8 bytes."""
    layout = message.read_layout(lambda n: raw[:8 * n].clone().view(torch.int64).tolist())
    aligned = raw.storage_offset() % 8 == 0
    tensors = [(part if aligned else part.clone()).view(DTYPES[p.code]).reshape(p.shape)
               for p, part in ((p, raw[p.offset:p.offset + p.size]) for p in layout.parts)]
    tail = bytes(raw[layout.tail_offset:layout.tail_offset + layout.tail_size].cpu().tolist())
    return message.rebuild(tail, tensors, _LEAVES)


def handed(values: Sequence[Any], names: Sequence[str], training: bool) -> List[Any]:
    """The values for a stage on this rank, in place of a message: each floating tensor detached when training
    (the receiver's own leaf, no copy), other tensors copied; refused as ``pack`` refuses them.

    Example:
        >>> h = torch.ones(2, requires_grad=True) * 2
        >>> [(t.requires_grad, t.data_ptr() == h.data_ptr()) for t in handed([h], ["h"], training=True)]
        [(False, True)]
    """
    if not all(isinstance(v, torch.Tensor) for v in values):
        message.check_sendable(values, names, _leaf)

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach() if training and t.is_floating_point() else t.clone()
    return [leaf(v) if isinstance(v, torch.Tensor) else pytree.tree_map(leaf, v) for v in values]


class TorchGraphStageWork:
    """Forward and backward of stage j of a graph split on micro-batch i, keeping what backward needs.

    ``stage`` takes the values ``split.reads[j]`` and returns the tuple ``split.sends[j]`` (a chain's
    stage: ``graph.chain.ChainStage``). The last stage gathers the model's outputs (its own and those sent
    to it), rebuilds the model's return value (``unflatten``: ``Captured.unflatten``, a chain's
    ``ChainPart.unflatten``) and turns it into the loss weighted by the micro-batch's share of rows. A
    micro-batch in ``recompute`` (activation checkpointing) keeps only the values its stage read until
    its backward, which runs the stage again first. An edge to or from a stage in ``local`` (held by the same
    rank) carries the values themselves (``handed``) rather than a packed message.
    """

    def __init__(self, stage: nn.Module, split: GraphSplit, j: int, unflatten: Callable[[Dict[str, Any]], Any],
                 device: torch.device, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]],
                 targets: List[torch.Tensor], weights: List[float], meter: ActivationMeter,
                 split_backward: Optional[SplitBackward] = None, recompute: Optional[StageRecompute] = None,
                 local: FrozenSet[int] = frozenset()) -> None:
        self.stage, self.split, self.j, self.unflatten, self.device = stage, split, j, unflatten, device
        self.split_backward, self.recompute, self.local = split_backward, recompute, local
        self.loss_fn, self.targets, self.weights, self.meter = loss_fn, targets, weights, meter
        self.last = j == split.stages - 1
        edges = stage_edges(split, j)
        self.incoming = {p: edge_values(split, p, j) for p in edges.sources}
        self.outgoing = {c: edge_values(split, j, c) for c in edges.targets}
        # Per micro-batch: the received tensors, what was sent (by target stage), the last stage's loss and,
        # recomputed, the values the stage read instead of the two before (its forward runs again in backward).
        self._saved: Dict[int, Tuple[Dict[int, List[torch.Tensor]], Any, Any, Any]] = {}
        self._received: Dict[int, Dict[int, List[Any]]] = {}  # per micro-batch, per source: the values as received
        self._kept: Dict[int, List[Any]] = {}  # what a checkpointed micro-batch read, counted by the meter
        self.outputs: List[Dict[str, Any]] = []
        self.loss_sum = 0.0

    def forward(self, i: int, received: Mapping[int, Any]) -> Dict[int, Any]:
        training = self.loss_fn is not None
        values: Dict[str, Any] = dict(received.get(-1, {}))
        held: Dict[int, List[torch.Tensor]] = {}
        for p, names in self.incoming.items():
            got = received[p] if p in self.local else unpack(received[p])
            tensors = [t for value in got for t in tensor_leaves(value)]
            for t in tensors:
                if training and t.is_floating_point():
                    t.requires_grad_()
            values.update(zip(names, got))
            held[p] = tensors
        if not training:
            values.update(zip(self.split.sends[self.j], self.stage(*[values[v] for v in self.split.reads[self.j]])))
            if self.last:
                outputs = {v: values[v] for v in self.split.graph.outputs}
                self.outputs.append({v: t.detach() if isinstance(t, torch.Tensor) else t for v, t in outputs.items()})
            return self._messages(values)
        self._received[i] = {p: [values[v] for v in names] for p, names in self.incoming.items()}
        if self.recompute is not None and i in self.recompute:
            read = dict(values)
            values, loss = self.recompute.forward(i, lambda: self._train(i, read))
            self._saved[i] = (held, None, None, read)
            self._kept[i] = self.meter.keep({id(t): t for v in read.values() for t in tensor_leaves(v)}.values())
        else:
            values, loss = self._train(i, values)
            self._saved[i] = (held, None if self.last else self._sent(values), loss, None)
        if loss is not None:
            self.loss_sum += float(loss.detach())
        return self._messages(values)

    def _train(self, i: int, read: Mapping[str, Any]) -> Tuple[Dict[str, Any], Any]:
        """Micro-batch i's stage run on the values it ``read``: every value then, and the last stage's weighted loss."""
        values = dict(read)
        args = [values[v] for v in self.split.reads[self.j]]
        if self.split_backward is not None:
            with self.split_backward.recording(i):
                sends = self.stage(*args)
        else:
            sends = self.stage(*args)
        values.update(zip(self.split.sends[self.j], sends))
        if not self.last:
            return values, None
        assert self.loss_fn is not None
        outputs = {v: values[v] for v in self.split.graph.outputs}
        target = self.targets[i] if self.targets else None  # None: the model's own loss reads its labels
        return values, self.loss_fn(self.unflatten(outputs), target) * self.weights[i]

    def _sent(self, values: Mapping[str, Any]) -> Dict[int, List[Any]]:
        return {c: [values[v] for v in names] for c, names in self.outgoing.items()}

    def _messages(self, values: Mapping[str, Any]) -> Dict[int, Any]:
        return {c: self._message(c, [values[v] for v in names], names) for c, names in self.outgoing.items()}

    def _message(self, peer: int, values: Sequence[Any], names: Sequence[str]) -> Any:
        """What goes to stage ``peer``: the values handed over on this rank, else packed."""
        if peer in self.local:
            return handed(values, names, self.loss_fn is not None)
        return pack(values, names, self.device)

    def backward(self, i: int, grads: Mapping[int, Any]) -> Dict[int, Any]:
        held, sent, loss, read = self._saved.pop(i)
        self._kept.pop(i, None)
        if read is not None:
            assert self.recompute is not None
            values, loss = self.recompute.replay(i, lambda: self._train(i, read))
            sent = None if self.last else self._sent(values)
        roots, upstream = ([loss], [None]) if loss is not None else self._roots(sent, grads, self.local)
        if self.split_backward is not None:
            inputs = [t for tensors in held.values() for t in tensors if t.requires_grad]
            found = iter(self.split_backward.input_pass(i, roots, upstream, inputs))
            back = {p: [next(found) if t.requires_grad else None for t in tensors] for p, tensors in held.items()}
        else:
            if roots:
                torch.autograd.backward(roots, upstream)  # a value sent to two stages: both gradients add up
            back = {p: [t.grad for t in tensors] for p, tensors in held.items()}
        received = self._received.pop(i)
        return {p: self._message(p, _with_tensors(received[p], [g if g is not None else torch.zeros_like(t)
                                                               for t, g in zip(held[p], gs)]), self.incoming[p])
                for p, gs in back.items()}

    def weight(self, i: int) -> None:
        assert self.split_backward is not None, "W actions come with a split backward"
        self.split_backward.weight_pass(i)

    @staticmethod
    def _roots(sent: Mapping[int, List[Any]], grads: Mapping[int, Any],
               local: FrozenSet[int]) -> Tuple[List[Any], List[Any]]:
        roots, upstream = [], []
        for c, message in grads.items():
            grads_of = [g for value in (message if c in local else unpack(message)) for g in tensor_leaves(value)]
            for t, g in zip([t for value in sent[c] for t in tensor_leaves(value)], grads_of):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    roots.append(t)
                    upstream.append(g.to(t.device))
        return roots, upstream


class HeldStageWorks:
    """The stages a rank holds, each made once as a call with its split backward and recompute; per step, their works.

    Args:
        modules: stage j's module per held stage (one: the rank's own module).
        split, unflatten, device: as ``TorchGraphStageWork``'s.
        chain: the modules are an ``nn.Sequential``'s layer groups (each called as a ``ChainStage``).
        split_backward: the schedule splits backward into B and W (a ``SplitBackward`` per stage).
        recomputed: the micro-batches that recompute their forward (activation checkpointing), if any.

    Example:
        >>> held = HeldStageWorks({0: stage}, split, unflatten, device, chain=True, split_backward=False,
        ...                       recomputed=frozenset())                                 # doctest: +SKIP
        >>> works = held.works(nn.MSELoss(), targets, [0.5, 0.5], meter)                  # doctest: +SKIP
    """

    def __init__(self, modules: Dict[int, nn.Module], split: GraphSplit, unflatten: Callable[[Dict[str, Any]], Any],
                 device: torch.device, *, chain: bool, split_backward: bool, recomputed: FrozenSet[int]) -> None:
        self.split, self.unflatten, self.device = split, unflatten, device
        #: Per held stage: a module taking the stage's reads and returning its sends.
        self.calls = {j: ChainStage(m) if chain else m for j, m in modules.items()}
        self.split_backwards = {j: SplitBackward(m) for j, m in self.calls.items()} if split_backward else {}
        # Activation checkpointing: one recompute per held stage (its random states and buffers its own).
        self.recomputes = {j: StageRecompute(modules[j], recomputed, device) for j in self.calls} if recomputed else {}

    def works(self, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]], targets: Sequence[torch.Tensor],
              weights: Sequence[float], meter: ActivationMeter) -> Dict[int, TorchGraphStageWork]:
        """One step's stage work per held stage (the last stage's reads ``targets``)."""
        last = self.split.stages - 1
        local = frozenset(self.calls)  # the edges between them are handed over in memory (``LocalLink``)
        return {j: TorchGraphStageWork(call, self.split, j, self.unflatten, self.device, loss_fn,
                                       list(targets) if j == last else [], list(weights), meter,
                                       self.split_backwards.get(j), self.recomputes.get(j), local)
                for j, call in self.calls.items()}

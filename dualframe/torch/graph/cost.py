"""What each node of a captured torch model costs on a sample batch (seconds or bytes) and how big each value is.

``stages=n`` hands these to the core's ``cut_graph``: per node the cost to even out across stages, per
value the bytes per sample that would cross a boundary cut there. Measuring runs the model forward
under ``no_grad`` on the sample; buffers (BatchNorm running statistics) and the RNG are restored after.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, NamedTuple, Set, Tuple

import torch
import torch.fx as fx

from dualframe.errors import StrategyError
from dualframe.torch.graph.capture import Captured
from dualframe.torch.graph.run import batch_size, tensor_leaves

BY = ("time", "memory")
Shapes = Dict[str, List[Tuple[Tuple[int, ...], torch.dtype]]]


class Measured(NamedTuple):
    """Per node cost, per value bytes per sample, per value tensor shapes and dtypes (on the sample)."""

    costs: List[float]
    sizes: Dict[str, float]
    shapes: Shapes


class _Meter(fx.Interpreter):
    """Runs the graph node by node, noting each node's seconds and output bytes."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seconds: Dict[str, float] = {}
        self.bytes: Dict[str, int] = {}
        self.shapes: Shapes = {}

    def run_node(self, n: fx.Node) -> Any:
        start = time.perf_counter()
        out = super().run_node(n)
        leaves = tensor_leaves(out)
        if any(t.is_cuda for t in leaves):
            torch.cuda.synchronize()
        self.seconds[n.name] = time.perf_counter() - start
        self.bytes[n.name] = sum(t.numel() * t.element_size() for t in leaves)
        self.shapes[n.name] = [(tuple(t.shape), t.dtype) for t in leaves]
        return out


def measure(captured: Captured, values: Dict[str, Any], by: str = "time",
            repeats: int = 3) -> Measured:
    """Per node cost (median forward seconds, or bytes of parameters + activations) and per value bytes per sample.

    Args:
        captured: the model, captured.
        values: the sample's inputs, {input value name: value} (``Captured.bind``).
        by: ``"time"`` or ``"memory"``.
        repeats: timed runs after one warm-up run.

    Raises:
        StrategyError: an unknown ``by``.
    """
    if by not in BY:
        raise StrategyError(f"by must be one of {', '.join(map(repr, BY))} (by: {by!r})")
    rows = max(batch_size(values), 1)
    args = [values[name] for name in captured.graph.inputs]
    buffers = {name: b.detach().clone() for name, b in captured.gm.named_buffers()}
    runs: List[_Meter] = []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for _ in range(repeats + 1 if by == "time" else 1):
                meter = _Meter(captured.gm)
                meter.run(*args)
                runs.append(meter)
    finally:
        with torch.no_grad():
            for name, b in captured.gm.named_buffers():
                b.copy_(buffers[name])
    timed = runs[1:] or runs
    sizes = {name: float(count) / rows for name, count in runs[0].bytes.items()}
    shapes = runs[0].shapes
    for name in captured.graph.inputs:
        leaves = tensor_leaves(values[name])
        sizes[name] = float(sum(t.numel() * t.element_size() for t in leaves)) / rows
        shapes[name] = [(tuple(t.shape), t.dtype) for t in leaves]
    if by == "time":
        costs = [statistics.median(m.seconds[node.name] for m in timed) for node in captured.graph.nodes]
    else:
        costs = _memory(captured, runs[0].bytes)
    return Measured(costs, sizes, shapes)


def _memory(captured: Captured, activation: Dict[str, int]) -> List[float]:
    """Per node: the bytes of its output plus those of the parameters it is the first to use."""
    seen: Set[int] = set()
    costs = []
    for node in captured.graph.nodes:
        fx_node = captured.nodes[node.name]
        owned: List[torch.Tensor] = []
        if fx_node.op == "call_module":
            owned = list(captured.gm.get_submodule(str(fx_node.target)).parameters())
        for arg in fx_node.all_input_nodes:
            if arg.op == "get_attr":
                attr = _attr(captured.gm, str(arg.target))
                if isinstance(attr, torch.Tensor):
                    owned.append(attr)
        fresh = [p for p in owned if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        costs.append(float(activation.get(node.name, 0) + sum(p.numel() * p.element_size() for p in fresh)))
    return costs


def _attr(root: torch.nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value

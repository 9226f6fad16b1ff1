"""A split graph's stage as one piece for a process pipeline, and the one packed message a boundary carries.

A process pipeline (``DistributedPipeline``) moves one tensor per micro-batch from a stage to the
next. A functional model's stage may read and send several values; they travel packed into one
float32 tensor, unpacked on arrival by the shapes and dtypes the graph gives them (both sides hold
it), and the gradient comes back the same way. Cuts that one message per neighbour cannot carry
(a value skipping a stage, several outputs) are refused before any communication.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from dualframe.errors import StrategyError
from dualframe.pipeline.graph import cut_graph
from dualframe.tensorflow.graph import KerasGraph, layers_called_first


def process_stages(captured: KerasGraph, balance: Sequence[int]) -> List[GraphStage]:
    """One ``GraphStage`` per stage of ``balance`` (units per stage), for a pipeline whose stages are processes.

    Raises:
        StrategyError: a cut the process pipeline cannot carry (``chain_problem``: a value skipping a stage,
            several outputs), naming the tensors; checked before any communication.
    """
    split = cut_graph(captured.graph, balance=balance)
    problem = chain_problem(captured, split)
    if problem is not None:
        raise StrategyError(f"DistributedPipeline sends one message from each stage to the next, but {problem}; "
                            f"choose another balance (see ModelParallel(model, balance={list(balance)}).describe()), "
                            "or split it in one process with hvd.Pipeline")
    return [GraphStage(captured, split, j, layers_called_first(captured, split, j)) for j in range(split.stages)]


class GraphStage:
    """Stage j of a split graph as one layer-like callable, for a process pipeline whose stage runs "layers".

    A process pipeline moves one tensor per micro-batch from a stage to the next. When several values
    cross a boundary (a block's two branches, an attention mask beside the hidden states) or one that
    is not floating-point, they travel packed: each flattened per row, cast to float32 and concatenated
    into one ``(rows, width)`` tensor, unpacked on arrival (shapes and dtypes from the graph, which both
    sides hold). The gradient comes back the same way, through the unpacking. Ints travel exactly up to
    2**24 (token ids, masks).

    Example:
        >>> split = cut_graph(captured.graph, balance=[3, 4])                             # doctest: +SKIP
        >>> stage = GraphStage(captured, split, 1, layers_called_first(captured, split, 1))  # doctest: +SKIP
        >>> y = stage(x, training=True)                                                   # doctest: +SKIP
    """

    def __init__(self, captured: KerasGraph, split: Any, j: int, layers: Sequence[Any]) -> None:
        self.captured, self.nodes = captured, split.stage_range(j)
        # What crosses a boundary, in production order: both sides of a message agree on it.
        self.reads = tuple(split.crossing(j - 1)) if j > 0 else tuple(split.graph.inputs)
        self.sends = tuple(split.crossing(j)) if j + 1 < split.stages else tuple(split.sends[j])
        self.packed_in = packed(captured, self.reads)
        self.packed_out = j + 1 < split.stages and packed(captured, self.sends)
        self.layers = list(layers)
        self.built = True

    def __call__(self, x: Any, training: Any = None) -> Any:
        values = dict(zip(self.reads, unpack(self.captured, self.reads, x) if self.packed_in else [x]))
        self.captured.run(self.nodes, values, training)
        out = [values[v] for v in self.sends]
        return pack(out) if self.packed_out else out[0]

    @property
    def trainable_weights(self) -> List[Any]:
        return [v for layer in self.layers for v in layer.trainable_weights]

    @property
    def weights(self) -> List[Any]:
        return [v for layer in self.layers for v in layer.weights]

    def get_weights(self) -> List[Any]:
        return [w for layer in self.layers for w in layer.get_weights()]

    def set_weights(self, weights: Sequence[Any]) -> None:
        start = 0
        for layer in self.layers:
            layer.set_weights(list(weights[start:start + len(layer.weights)]))
            start += len(layer.weights)


def model_inputs(captured: KerasGraph, inputs: Any) -> Any:
    """The caller's inputs as the first ``GraphStage`` takes them: one tensor, or several packed into one."""
    flat = captured.flat_inputs(inputs)
    return pack(flat) if packed(captured, captured.graph.inputs) else flat[0]


def packed(captured: KerasGraph, values: Sequence[str]) -> bool:
    """Whether ``values`` cross a boundary packed into one float32 tensor (several, or one not float32)."""
    return len(values) != 1 or captured.specs[values[0]].dtype != "float32"


def pack(tensors: Sequence[Any]) -> Any:
    """Tensors of any shape and dtype with the same rows as one float32 ``(rows, width)`` tensor."""
    return tf.concat([tf.reshape(tf.cast(x, tf.float32), [tf.shape(x)[0], -1]) for x in tensors], axis=1)


def unpack(captured: KerasGraph, values: Sequence[str], x: Any) -> List[Any]:
    """``pack``'s tensors back, with the shapes and dtypes the graph gives ``values``."""
    specs = [captured.specs[v] for v in values]
    widths = [int(np.prod(spec.shape[1:], dtype=np.int64)) for spec in specs]
    return [tf.cast(tf.reshape(part, [-1, *spec.shape[1:]]), spec.dtype)
            for part, spec in zip(tf.split(x, widths, axis=1), specs)]


def chain_problem(captured: KerasGraph, split: Any) -> Optional[str]:
    """Why a process pipeline cannot carry ``split`` today (one message from each stage to the next); None if it can.

    It can when the model has one output and every value crossing a boundary goes from the stage
    before it to the stage after it (none skips a stage, no model input is read after the first stage);
    several values, or a non-float32 one, must have static shapes (they travel packed).
    """
    graph = split.graph
    if len(graph.outputs) != 1:
        return f"the model has {len(graph.outputs)} outputs (one is carried)"
    if packed(captured, graph.inputs) and any(captured.bytes_per_sample(v) is None for v in graph.inputs):
        return "the model's inputs travel packed (several, or not float32) but their shapes are not static"
    for j in range(split.stages - 1):
        crossing = split.crossing(j)
        for v in crossing:
            if split.producer[v] != j:
                return f"{v} skips stage {j} on its way to stage {j + 1} (it would be relayed, not sent directly)"
            if packed(captured, crossing) and captured.bytes_per_sample(v) is None:
                return f"{v} crosses between stages {j} and {j + 1} packed with others but its shape is not static"
    if split.producer[graph.outputs[0]] != split.stages - 1:
        return f"the output {graph.outputs[0]} is made before the last stage"
    return None

"""A split graph's stage for a process pipeline: the cut every rank makes alike, and the layers and nodes stage j runs.

``DistributedPipeline`` of a functional model keeps one ``GraphStage`` per rank: it runs the stage's
nodes on the values it is given (model inputs, values received from the stages that made them) and
holds the variables of the layers it calls first, in the model's weight order. What travels between
stages, and how, is ``graph_stage_work`` (one packed message per edge, along the core's
``dualframe.pipeline.graph_walk``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import keras

from dualframe.errors import StrategyError
from dualframe.pipeline.graph import GraphSplit
from dualframe.tensorflow.graph.capture import KerasGraph, capture, layers_called, layers_called_first
from dualframe.tensorflow.graph.masks import chain_mask_crossing
from dualframe.tensorflow.graph.cut import split_model


def process_stages(captured: KerasGraph, *, split_points: Optional[Sequence[str]] = None,
                   balance: Optional[Sequence[int]] = None,
                   stages: Optional[int] = None) -> Tuple[GraphSplit, List["GraphStage"]]:
    """The cut (one of ``split_points``, ``balance`` in layers, ``stages``) and one ``GraphStage`` per stage.

    Any cut works: a value skipping stages goes straight to its reader, several outputs go to the last
    stage. Every rank must cut alike, so ``stages=n`` balances memory from the static shapes (parameter
    plus output bytes per layer), never timings, which differ between ranks; for a cut by time, measure
    once with ``ModelParallel(..., stages=n, sample=...)`` and pass its ``split_points``.
    """
    split = split_model(captured, split_points=split_points, balance=balance, stages=stages, by="memory")
    held: List[GraphStage] = []
    earlier: Set[int] = set()  # variables an earlier stage holds (a nested model's layers' included)
    for j in range(split.stages):
        first = [layer for layer in layers_called_first(captured, split, j)
                 if not (layer.weights and all(id(v) in earlier for v in layer.weights))]
        again = [layer for layer in layers_called(captured, split, j) if all(layer is not f for f in first)]
        earlier.update(id(v) for layer in first for v in layer.weights)
        held.append(GraphStage(captured, split, j, first, again))
    return split, held


class GraphStage:
    """Stage j of a split graph: its nodes, and the layers whose variables it holds (the weights API of a layer).

    ``tied`` are the layers it calls that an earlier stage calls first: it trains its copy of their
    trainable variables too (``trainable_weights``), while ``weights``/``get_weights()`` list only the
    layers it calls first, so that the stages' lists join into the model's.

    Example:
        >>> split, stages = process_stages(captured, split_points=["block2"])                 # doctest: +SKIP
        >>> values = {"x": x}; stages[0].run(values, training=True)          # doctest: +SKIP
        >>> [values[v] for v in split.sends[0]]                              # doctest: +SKIP
    """

    def __init__(self, captured: KerasGraph, split: GraphSplit, j: int, layers: Sequence[Any],
                 tied: Sequence[Any] = ()) -> None:
        self.captured, self.nodes = captured, split.stage_range(j)
        self.layers, self.tied = list(layers), list(tied)
        self.built = True

    def run(self, values: Dict[str, Any], training: Any = None) -> None:
        """Run the stage's nodes on ``values`` (what it reads, by value name), adding what they make."""
        self.captured.run(self.nodes, values, training)

    @property
    def trainable_weights(self) -> List[Any]:
        """The trainable variables of the layers it calls first, then its copies of the tied layers' (each once)."""
        own = {id(v): v for layer in self.layers for v in layer.trainable_weights}
        for v in (v for layer in self.tied for v in layer.trainable_weights):
            own.setdefault(id(v), v)
        return list(own.values())

    @property
    def weights(self) -> List[Any]:
        return [v for layer in self.layers for v in layer.weights]

    @property
    def variables(self) -> List[Any]:
        """Every variable of the stage's layers (seed generators too): what its stage checkpoint holds."""
        return [v for layer in self.layers for v in layer.variables]

    def get_weights(self) -> List[Any]:
        return [w for layer in self.layers for w in layer.get_weights()]

    def set_weights(self, weights: Sequence[Any]) -> None:
        start = 0
        for layer in self.layers:
            layer.set_weights(list(weights[start:start + len(layer.weights)]))
            start += len(layer.weights)


def layers_of(layers: Any) -> List[Any]:
    """The layers of a keras.Sequential or a list of Keras layers (anything else refused by name)."""
    if isinstance(layers, keras.Sequential):
        return list(layers.layers)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not all(
            isinstance(layer, keras.layers.Layer) for layer in layers):
        raise StrategyError(
            f"DistributedPipeline splits a keras.Sequential or a list of Keras layers (layers: {type(layers).__name__})")
    return list(layers)


def refuse_masks_crossing(layers: Sequence[Any], ranges: Sequence[range]) -> None:
    """Refuse a cut of a chain where a Keras mask may cross: a chain's messages carry tensors, not their masks."""
    found = chain_mask_crossing(layers, [r.stop for r in ranges[:-1]])
    if found is not None:
        raise StrategyError(
            f"layer {found[0]!r} {found[1]}, which a chain of layers does not carry between processes; pass the "
            "functional model (keras.Model(inputs, outputs)), whose masks cross, or a keras.Sequential built on a "
            "keras.Input cut after the layer that reads the mask")


def graph_of(layers: Any) -> Optional[KerasGraph]:
    """A functional model's graph (a subclassed one: TraceError); None for a Sequential or a list."""
    if isinstance(layers, keras.Model) and not isinstance(layers, keras.Sequential):
        return capture(layers)
    return None

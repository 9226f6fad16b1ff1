"""The full model's weights through a Keras process pipeline's stages: get, set and gather them in the model's order."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd


def tied_parts(all_layers: Sequence[Any], mine: Sequence[Any], weights: Sequence[Any]) -> List[Tuple[Any, List[Any]]]:
    """Per layer this graph stage holds a copy of (``GraphStage.tied``), its values in the full model's list."""
    offsets: Dict[int, Tuple[Any, int]] = {}
    start = 0
    for stage in all_layers:
        for layer in getattr(stage, "layers", [stage]):
            offsets[id(layer)] = (layer, start)
            start += len(layer.weights)
    parts = []
    for stage in mine:
        for layer in getattr(stage, "tied", []):
            begin = offsets[id(layer)][1]
            parts.append((layer, list(weights[begin:begin + len(layer.weights)])))
    return parts


class StageWeights:
    """``DistributedPipeline``'s weights in the full model's order (its ``layers``, ``_all_layers``, ``sharded``).

    Example:
        >>> # pipe.set_weights(model.get_weights()); merged = pipe.gather_weights()  # on every rank
    """

    layers: List[Any]
    layer_indices: Sequence[int]
    _all_layers: List[Any]
    sharded: Any
    role: Any
    pipeline_set: Any

    def _gathered(self) -> Any:
        """The stage's full values in its variables inside: with ``shard="parameters"``, a collective of its replicas."""
        return contextlib.nullcontext() if self.sharded is None else self.sharded.gathered()

    @property
    def all_layers(self) -> List[Any]:
        """Every layer of the full model, in order (this stage holds ``layers``, those at ``layer_indices``)."""
        return self._all_layers

    @property
    def trainable_variables(self) -> List[tf.Variable]:
        """The local stages' trainable variables, in layer order, each once (two held stages may call one layer)."""
        return list({id(v): v for layer in self.layers for v in layer.trainable_weights}.values())

    @property
    def variables(self) -> List[Any]:
        """All the local stage's variables (``get_weights`` order)."""
        return [v for layer in self.layers for v in layer.weights]

    def get_weights(self) -> List[np.ndarray]:
        """The local stage's weights, in the full model's order: the stages' lists concatenate into the model's.

        With a ``shard="parameters"`` optimizer the stage's replicas gather them first: every replica calls it.
        """
        with self._gathered():
            return [w for layer in self.layers for w in layer.get_weights()]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Take this stage's part of the full model's ``get_weights()`` list (layers must be built)."""
        if not all(layer.built for stage in self._all_layers for layer in stage.layers):
            raise StrategyError("set_weights needs the full model built: give the keras.Sequential a keras.Input")
        counts = [len(layer.weights) for layer in self._all_layers]
        if len(weights) != sum(counts):
            raise StrategyError(f"set_weights takes the full model's list (weights: {len(weights)}, model: {sum(counts)})")
        for index, layer in zip(self.layer_indices, self.layers):
            start = sum(counts[:index])
            layer.set_weights(list(weights[start:start + len(layer.weights)]))
        for tied, values in tied_parts(self._all_layers, self.layers, weights):  # this stage's copies of tied layers
            tied.set_weights(values)
        if self.sharded is not None:  # this rank keeps its slices of them (no communication)
            self.sharded.reload()

    def gather_weights(self) -> List[np.ndarray]:
        """The full model's weights, merged from every stage of this pipeline (a collective: call it on all ranks)."""
        with self._gathered():
            mine = [(index, layer.get_weights()) for index, layer in zip(self.layer_indices, self.layers)]
        parts = hvd.allgather_object(mine, name=f"{self.role.link.prefix}.weights", process_set=self.pipeline_set)
        return [w for _, layer in sorted(item for part in parts for item in part) for w in layer]


"""ZeRO-3 layer by layer for Keras 3: each layer gathers its values just before its call, and again for its backward.

Each top-level layer of the sharded model (``model.layers``) owns the buckets of its trainable
variables (the layout groups variables by layer). Its ``call`` is replaced by one that, inside a
``tf.custom_gradient``, allgathers the layer's slices, runs the original call in a
``keras.StatelessScope`` mapping each variable to its gathered value, and lets the values go. Its
gradient gathers them again, recomputes the layer's call under a tape (the layer's inputs are kept,
its inner activations and values are not), and reduce-scatters the gradient of the values into the
gradient of this rank's slices. Each gather waits for the layer's inputs (forward) or for the gradient
reaching the layer (backward), also when traced, so at most one layer's full values and full gradients
exist at a time, at the cost of a second forward of each layer and two gathers per layer and step (no prefetch).

Non-trainable variables (batch-norm statistics, dropout seeds) are read from their replicated copies;
the recomputation reads the same values the forward read, so dropout draws the same mask, and the
forward's updates alone are kept.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Sequence

import keras
import tensorflow as tf

from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.gradients import SHARD_SCOPE, collective_scope, named


def layer_groups(model: keras.Model) -> List[str]:
    """A bucket key per trainable variable: its top-level layer and dtype (variables of one layer share buckets).

    Raises:
        StrategyError: a variable used by two top-level layers (it could be gathered by one only).
    """
    owner: Dict[int, int] = {}
    for j, layer in enumerate(model.layers):
        for variable in layer.trainable_variables:
            if owner.setdefault(id(variable), j) != j:
                raise StrategyError(
                    f"shard='parameters' gathers each layer's values for that layer; {variable.path} is used by "
                    f"layers {model.layers[owner[id(variable)]].name!r} and {layer.name!r}; use shard='gradients'")
    missing = [v.path for v in model.trainable_variables if id(v) not in owner]
    if missing:
        raise StrategyError(f"shard='parameters' needs every trainable variable inside one of the model's layers "
                            f"(not: {', '.join(missing[:3])}); use shard='gradients'")
    return [f"{owner[id(v)]}/{v.dtype}" for v in model.trainable_variables]


def install(optimizer: Any, model: keras.Model) -> None:
    """Replace the ``call`` of each top-level layer that holds variables by its gathering version."""
    zero = optimizer._zero
    index = {id(v): t for t, v in enumerate(zero.variables)}
    replicated = {id(v): holder for v, holder in zip(model.non_trainable_variables, zero.replicated)}
    for j, layer in enumerate(model.layers):
        if not layer.variables:  # (a Dropout has no weights, but its seed generator's state)
            continue
        own = {index[id(v)] for v in layer.trainable_variables}
        buckets = [b for b, bucket in enumerate(zero.layout.buckets) if own & set(bucket.tensors)]
        unit = _Unit(optimizer, layer, layer.call, buckets, [index[id(v)] for v in layer.trainable_variables],
                     [replicated[id(v)] for v in layer.non_trainable_variables], j)
        layer.call = functools.partial(_gathered_call, unit)


class _Unit:
    """One layer's share: its original call, its buckets, its variables' indices and replicated holders."""

    def __init__(self, optimizer: Any, layer: Any, call: Any, buckets: List[int], tensors: List[int],
                 holders: List[Any], j: int) -> None:
        self.optimizer, self.layer, self.call, self.buckets = optimizer, layer, call, buckets
        self.tensors, self.holders, self.j = tensors, holders, j

    def gather(self, slices: Sequence[Any], role: str) -> List[Any]:
        """The layer's trainable values, in ``layer.trainable_variables`` order, allgathered from ``slices``."""
        optimizer = self.optimizer
        process_set = optimizer.reduction.process_set
        flats = list(slices)
        if process_set.size() > 1 and flats:
            with collective_scope(SHARD_SCOPE):
                flats = list(hvd.grouped_allgather(named(flats, f"layer{self.j}_{role}"), process_set=process_set))
        values = optimizer._zero.unflatten(flats, self.buckets)
        return [values[t] for t in self.tensors]

    def run(self, values: Sequence[Any], stats: Sequence[Any], args: Any, kwargs: Dict[str, Any]) -> Any:
        layer = self.layer
        mapping = list(zip(layer.trainable_variables, values)) + list(zip(layer.non_trainable_variables, stats))
        with keras.StatelessScope(state_mapping=mapping, initialize_variables=False) as scope:
            outputs = self.call(*args, **kwargs)
        return outputs, [scope.get_current_value(v) for v in layer.non_trainable_variables]


def _differentiable(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable)) and value.dtype.is_floating


def _gathered_call(unit: _Unit, *args: Any, **kwargs: Any) -> Any:
    flat_args = tf.nest.flatten(args)
    where = [i for i, a in enumerate(flat_args) if _differentiable(a)]
    stats = [tf.convert_to_tensor(h) for h in unit.holders]
    slices = [tf.convert_to_tensor(unit.optimizer._zero.slices[b]) for b in unit.buckets]
    if not where and not slices:  # nothing to differentiate (a frozen embedding of token ids): just map the state
        outputs, updated = unit.run([], stats, args, kwargs)
        for holder, value in zip(unit.holders, updated):
            holder.assign(value)
        return outputs
    structure: List[Any] = []
    updates: List[Any] = []

    def with_inputs(inputs: Sequence[Any]) -> Any:
        flat = list(flat_args)
        for i, value in zip(where, inputs):
            flat[i] = value
        return tf.nest.pack_sequence_as(args, flat)

    @tf.custom_gradient
    def gathered(*tensors: Any) -> Any:
        inputs, own = list(tensors[:len(where)]), list(tensors[len(where):])
        # Traced, a gather depends on the slices alone and could run at the step's start with every other
        # layer's: it waits for the layer's inputs (and, backward, for the gradient reaching the layer).
        with tf.control_dependencies(inputs):
            values = unit.gather(own, "gather")
        outputs, updated = unit.run(values, stats, with_inputs(inputs), kwargs)
        structure.append(outputs)
        updates.extend(updated)

        def backward(*upstream: Any) -> List[Any]:
            with tf.control_dependencies([g for g in upstream if g is not None]):
                values = unit.gather(own, "regather")
            with tf.GradientTape() as tape:
                tape.watch(inputs + values)
                again, _ = unit.run(values, stats, with_inputs(inputs), kwargs)  # its updates are dropped
            grads = tape.gradient(tf.nest.flatten(again), inputs + values, output_gradients=list(upstream))
            by_variable: List[Any] = [None] * len(unit.optimizer._zero.variables)
            for t, grad in zip(unit.tensors, grads[len(inputs):]):
                by_variable[t] = grad
            scattered = unit.optimizer._reduce_scatter(by_variable, unit.buckets, f"layer{unit.j}_")
            return list(grads[:len(inputs)]) + scattered

        return tf.nest.flatten(outputs), backward

    flat_outputs = gathered(*[flat_args[i] for i in where], *slices)
    for holder, value in zip(unit.holders, updates):
        holder.assign(value)
    return tf.nest.pack_sequence_as(structure[0], flat_outputs)

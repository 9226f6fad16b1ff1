"""ZeRO-3 layer by layer for Keras 3: each layer gathers its values just before its call, and again for its backward.

Each top-level layer of the sharded model (``model.layers``) is a block of the core's ZeRO-3 plan
(``dualframe.dp.zero3``, the arithmetic torch's modules use): it owns one bucket per dtype of its
trainable variables. Its ``call`` is replaced by one that, inside a
``tf.custom_gradient``, allgathers the layer's slices, runs the original call in a
``keras.StatelessScope`` mapping each variable to its gathered value, and lets the values go. Its
gradient gathers them again, recomputes the layer's call under a tape (the layer's inputs are kept,
its inner activations and values are not), and reduce-scatters the gradient of the values into the
gradient of this rank's slices. In a traced step each gather starts one layer ahead (:class:`Ahead`,
in the core's ``GatherOrder``): forward, when the previous layer's inputs are ready; backward, when the
gradient reaches the layer after it. So at most two layers' full values and one layer's full gradient
exist at a time, at the cost of a second forward of each layer and two gathers per layer and step.
The model's last ``keep_gathered`` layers holding variables (the optimizer's, default 1) keep their
values and inner activations from forward to backward instead: their backward runs on the forward's
own tape, with no second gather and no recomputation (the last layer's regather would come at once).

Non-trainable variables (batch-norm statistics, dropout seeds) are read from their replicated copies;
the recomputation reads the same values the forward read, so dropout draws the same mask, and the
forward's updates alone are kept.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

from dualframe.dp.shard import ShardLayout
from dualframe.dp.zero3 import GatherOrder, ParameterShardPlan, block_paths, check_unshared
from dualframe.errors import StrategyError
from dualframe.tensorflow.collectives import hvd
from dualframe.tensorflow.dp.gradients import SHARD_SCOPE, collective_scope, named


def layer_plan(model: keras.Model, ranks: int,
               bucket_elements: Optional[int] = None) -> Tuple[ShardLayout, Dict[int, Tuple[int, ...]]]:
    """The core's ZeRO-3 plan for ``model``'s top-level layers, as one layout and each layer's buckets.

    Each top-level layer (``model.layers``) is a block of ``dualframe.dp.zero3``: its trainable
    variables form one bucket per dtype (more past ``bucket_elements``), cut among ``ranks``, as torch
    cuts a module's parameters.

    Returns:
        The joined ``ShardLayout`` (tensors numbered as ``model.trainable_variables``) and, per index of
        a layer with trainable variables, the indices of its buckets.

    Raises:
        StrategyError: a variable used by two top-level layers (each frees its own after its call), or
            one outside every layer.
    """
    return layers_plan(model.layers, model.trainable_variables, ranks, bucket_elements)


def layers_plan(layers: Sequence[Any], variables: Sequence[Any], ranks: int,
                bucket_elements: Optional[int] = None) -> Tuple[ShardLayout, Dict[int, Tuple[int, ...]]]:
    """:func:`layer_plan` for ``layers`` holding ``variables`` (a model's, or a pipeline stage's)."""
    names = [f"{j}_{layer.name}".replace(".", "_") for j, layer in enumerate(layers)]  # one path level each
    holders: Dict[int, List[str]] = {}
    for name, layer in zip(names, layers):
        for variable in layer.trainable_variables:
            holders.setdefault(id(variable), []).append(f"{name}.{variable.name}")
    check_unshared({held[0]: held for held in holders.values()})
    missing = [v.path for v in variables if id(v) not in holders]
    if missing:
        raise StrategyError(f"shard='parameters' needs every trainable variable inside one of the model's layers "
                            f"(not: {', '.join(missing[:3])}); use shard='gradients'")
    paths = block_paths([(name, False) for name in names])
    plan = ParameterShardPlan.build([holders[id(v)][0] for v in variables], [int(np.prod(v.shape)) for v in variables],
                                    paths, ranks, dtypes=[str(v.dtype) for v in variables],
                                    bucket_elements=bucket_elements)
    layout, owned = plan.joined()
    return layout, {paths.index(block.path) - 1: buckets for block, buckets in zip(plan.blocks, owned)}


def install(optimizer: Any, model: keras.Model) -> None:
    """Replace the ``call`` of each top-level layer that holds variables by its gathering version."""
    zero = optimizer._zero
    index = {id(v): t for t, v in enumerate(zero.variables)}
    replicated = {id(v): holder for v, holder in zip(model.non_trainable_variables, zero.replicated)}
    ahead = zero.ahead = Ahead()
    # The last layers of the forward are the first of the backward: kept, they skip a gather and a recomputation.
    order = GatherOrder(order=[j for j in range(len(model.layers)) if zero.blocks.get(j)], settled=True)
    for j, layer in enumerate(model.layers):
        if not layer.variables:  # (a Dropout has no weights, but its seed generator's state)
            continue
        unit = _Unit(optimizer, layer, layer.call, list(zero.blocks.get(j, ())),
                     [index[id(v)] for v in layer.trainable_variables],
                     [replicated[id(v)] for v in layer.non_trainable_variables], j)
        unit.ahead = ahead
        unit.kept = order.kept(j, optimizer.keep_gathered)
        layer.call = functools.partial(_gathered_call, unit)


class Ahead:
    """When a layer's gather may start, traced: one layer ahead, in the core's ``GatherOrder``.

    Forward, layer ``j``'s gather waits for the inputs of the layer that ran before it (so it runs
    while that layer gathers and computes); backward, its regather waits for the gradient reaching
    the layer after it. At most two layers' full values exist at once. Eager steps run in order
    anyway; a tensor of another graph (an earlier trace) is not waited on: the layer's own is.
    """

    def __init__(self, prefetch: bool = True) -> None:
        self.prefetch = prefetch
        self.order = GatherOrder()
        self.forward: Dict[Optional[int], List[Any]] = {}
        self.backward: Dict[Optional[int], List[Any]] = {}

    def inputs(self, j: int, mine: List[Any]) -> List[Any]:
        """What layer ``j``'s forward gather waits for, ``mine`` being its inputs."""
        self.order.seen(j)
        self.forward[j] = mine
        return self._earlier(self.forward.get(self.order.next_backward(j) if self.prefetch else j, []), mine)

    def upstream(self, j: int, mine: List[Any]) -> List[Any]:
        """What layer ``j``'s backward regather waits for, ``mine`` being the gradient reaching it."""
        self.backward[j] = mine
        return self._earlier(self.backward.get(self.order.next_forward(j) if self.prefetch else j, []), mine)

    @staticmethod
    def _earlier(previous: List[Any], mine: List[Any]) -> List[Any]:
        graph = tf.compat.v1.get_default_graph()
        if tf.executing_eagerly() or not previous or any(getattr(t, "graph", None) is not graph for t in previous):
            return mine
        return previous


class _Unit:
    """One layer's share: its original call, its buckets, its variables' indices and replicated holders."""

    def __init__(self, optimizer: Any, layer: Any, call: Any, buckets: List[int], tensors: List[int],
                 holders: List[Any], j: int) -> None:
        self.optimizer, self.layer, self.call, self.buckets = optimizer, layer, call, buckets
        self.tensors, self.holders, self.j = tensors, holders, j
        self.ahead = Ahead()  # install shares one among the model's layers
        self.kept = False  # its gathered values (and inner activations) kept from its forward to its backward

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

    def run(self, values: Sequence[Any], stats: Sequence[Any], args: Any, kwargs: Dict[str, Any],
            autocast: Any = None) -> Any:
        """The original call on ``values`` and ``stats``; ``autocast``: the forward's autocast scope, for the backward."""
        layer = self.layer
        # The backward's recomputation runs outside the layer's __call__, which entered the mixed policy's
        # autocast scope (float32 values read as float16): it enters the forward's scope again.
        cast = AutocastScope(autocast.dtype) if autocast is not None else contextlib.nullcontext()
        mapping = list(zip(layer.trainable_variables, values)) + list(zip(layer.non_trainable_variables, stats))
        with _StoredDtypes():  # the scope casts each value to its variable's dtype: a float16 one's master included
            scope = keras.StatelessScope(state_mapping=mapping, initialize_variables=False)
        with cast, scope:
            outputs = self.call(*args, **kwargs)
        return outputs, [scope.get_current_value(v) for v in layer.non_trainable_variables]

    def recomputed(self, own: List[Any], inputs: List[Any], stats: Sequence[Any], args: Any, kwargs: Dict[str, Any],
                   autocast: Any, upstream: Sequence[Any], waited: List[Any]) -> List[Any]:
        """The gradients for ``inputs`` and the values: gathered again after ``waited``, the call recomputed on a tape."""
        with tf.control_dependencies(waited):
            values = self.gather(own, "regather")
        with tf.GradientTape() as tape:
            tape.watch(inputs + values)
            again, _ = self.run(values, stats, args, kwargs, autocast)  # updates dropped
        return list(tape.gradient(tf.nest.flatten(again), inputs + values, output_gradients=list(upstream)))


class _StoredDtypes:
    """No autocast scope: variables read, and report their dtype, as stored.

    Inside a layer's ``__call__`` under a mixed policy a variable reads (and its ``dtype`` reads) as
    the compute dtype; ``AutocastScope(None)`` stops the cast but makes ``dtype`` read as floatx.
    """

    def __enter__(self) -> None:
        self.outer = get_autocast_scope()
        global_state.set_global_attribute("autocast_scope", None)

    def __exit__(self, *exc: Any) -> None:
        global_state.set_global_attribute("autocast_scope", self.outer)


def _differentiable(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable)) and value.dtype.is_floating


def _gathered_call(unit: _Unit, *args: Any, **kwargs: Any) -> Any:
    flat_args = tf.nest.flatten(args)
    where = [i for i, a in enumerate(flat_args) if _differentiable(a)]
    # Read as stored (float32 under a mixed policy), not in the autocast scope of the layer's __call__: the
    # gather carries the masters and the layer casts what it reads, so the gradient comes back float32.
    with _StoredDtypes():
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
        with tf.control_dependencies(unit.ahead.inputs(unit.j, inputs)):
            values = unit.gather(own, "gather")
        autocast = get_autocast_scope()
        with tf.GradientTape() if unit.kept else contextlib.nullcontext() as kept:
            if kept is not None:
                kept.watch(inputs + values)
            outputs, updated = unit.run(values, stats, with_inputs(inputs), kwargs)
        structure.append(outputs)
        updates.extend(updated)

        def backward(*upstream: Any) -> List[Any]:
            waited = unit.ahead.upstream(unit.j, [g for g in upstream if g is not None])
            if kept is not None:  # the forward's own tape: no second gather, no recomputation
                grads = kept.gradient(tf.nest.flatten(outputs), inputs + values, output_gradients=list(upstream))
            else:
                grads = unit.recomputed(own, inputs, stats, with_inputs(inputs), kwargs, autocast, upstream, waited)
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

"""Capturing a Keras 3 model as the core's ``Graph``, and running a range of its nodes the way ``Functional`` does.

A functional ``keras.Model`` is read from its own graph: every call of a layer (a Keras ``Node``, with
the ``KerasTensor`` arguments it was called with) becomes a ``GraphNode`` whose scope and unit are
the layer's name; ``InputLayer``s are nodes that run nothing, so that ``balance=`` counts
``len(model.layers)`` (a model built as a stack of repeated blocks, a keras_hub backbone: the blocks,
``block_units``). Nodes come in the order ``Functional`` runs them (deepest first; within a
depth, ``model.operations`` order), which is ``model.layers`` order when no layer is shared. A layer
called twice is two nodes with the same scope (the core refuses it as a split point); a nested
``keras.Model`` is one leaf node (it runs whole; its layers cannot begin a stage). A
``keras.Sequential`` or a list of layers is a chain: one node per layer, each taking one tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from dualframe.pipeline.units import block_units as units_of
from dualframe.errors import TraceError
from dualframe.pipeline.graph import Graph, GraphNode, GraphSplit
from dualframe.tensorflow.graph.masks import chain_masks, mask_outputs, mask_reads

# Keras has no public getter for the implicit mask a layer sets on its output tensor (the _keras_mask attribute).
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
# Keras has no public name for a functional model's class (a subclass calling Model(inputs, outputs)
# is one too); its nodes and their arguments below are equally internal, read as Functional reads them.
from keras.src.models.functional import Functional

CHAIN_INPUT = "input"


@dataclass(frozen=True)
class Call:
    """How to run one node: the operation, and its Keras arguments (None: one positional tensor, a chain).

    ``masks`` carries Keras's implicit masks (``mask_zero=True``, ``supports_masking``) across a cut:
    Keras hands a mask from layer to layer as an attribute of the tensor (``_keras_mask``), which a copy
    onto another device, a message or a compiled function's argument does not keep. Each pair is
    (position in ``node.inputs`` of a value that had a mask when the model was built, position of that
    mask's own value); the mask is put back on the tensor before the call when it has none. The last
    ``len(mask_outputs)`` outputs of a node are the masks Keras set on its outputs (by index).
    """

    operation: Any
    arguments: Any = None
    keys: Tuple[int, ...] = ()  # id() of each KerasTensor argument, aligned with GraphNode.inputs
    masks: Tuple[Tuple[int, int], ...] = ()
    mask_outputs: Tuple[int, ...] = ()

    def __call__(self, values: Dict[str, Any], node: GraphNode, training: Any) -> List[Any]:
        for value_at, mask_at in self.masks:
            tensor = values[node.inputs[value_at]]
            if get_keras_mask(tensor) is None:
                set_keras_mask(tensor, values[node.inputs[mask_at]])
        if self.arguments is None:
            args, kwargs = [values[node.inputs[0]]], {}
        else:
            args, kwargs = self.arguments.fill_in({key: values[v] for key, v in zip(self.keys, node.inputs)})
        # As Functional (operation_fn): training replaces the value Keras recorded when the model was built
        # (a Dropout's node holds training=False), and only for operations that take it (layers, not keras.ops).
        if training is not None and "training" in getattr(self.operation, "_call_context_args", ()):
            kwargs = {**kwargs, "training": training}
        outputs = list(keras.tree.flatten(self.operation(*args, **kwargs)))
        masks = [get_keras_mask(outputs[t]) for t in self.mask_outputs]
        for t, mask in zip(self.mask_outputs, masks):
            if mask is None:
                raise TraceError(f"layer {node.scope!r} set no mask on its output {t} when it ran, though it had one "
                                 "when the model was built; dualframe carries Keras masks across a cut only when "
                                 "the layer makes them alike both times")
        return outputs + masks


@dataclass(frozen=True)
class KerasGraph:
    """A Keras model as the core's ``Graph`` plus what runs each node.

    Example:
        >>> x = keras.Input((4,), name="x")
        >>> model = keras.Model(x, keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="body")(x)))
        >>> captured = capture(model)
        >>> [node.scope for node in captured.graph.nodes], captured.graph.outputs
        (['x', 'body', 'head'], ('head',))

    Attributes:
        graph: nodes in execution order, values named by the layer that makes them (``"dense@1"``: its
            second call in this model; ``"lstm#0"``: its first output).
        calls: per node, how to run it (None for an ``InputLayer``).
        layers: the model's layers (``model.layers``, or the list given), in weight order.
        model: the model given (functional or Sequential), or None for a list of layers.
        specs: per value, its symbolic tensor (shape with the batch first, dtype) when known.
        nested: per nested model, the names of the layers inside it (they cannot begin a stage).
        output_masks: the model outputs that carry a Keras mask (by index); their masks' values follow
            the outputs in ``graph.outputs``, and ``pack_outputs`` puts them back on the outputs (a Keras
            loss weighs by them, as on the unsplit model).
    """

    graph: Graph
    calls: Tuple[Optional[Call], ...]
    layers: Tuple[Any, ...]
    model: Any
    specs: Dict[str, Any]
    nested: Dict[str, Tuple[str, ...]]
    output_masks: Tuple[int, ...] = ()

    @property
    def functional(self) -> bool:
        """Whether the graph was read from a functional model (else: a chain of layers)."""
        return isinstance(self.model, Functional)

    def run(self, nodes: range, values: Dict[str, Any], training: Any = None) -> None:
        """Run ``nodes`` in order, reading their inputs from ``values`` and adding their outputs to it."""
        for k in nodes:
            call, node = self.calls[k], self.graph.nodes[k]
            if call is not None:
                values.update(zip(node.outputs, call(values, node, training)))

    def check_masks_kept(self, nodes: range, values: Dict[str, Any]) -> None:
        """Refuse a stage of a chain whose last output has a Keras mask that the next stage would not get.

        A list of layers (or a Sequential not built on a ``keras.Input``) says nothing about masks
        before it runs; its masks stay on their tensors inside a stage only.

        Raises:
            TraceError: the stage's last layer set a mask on the value the next stage reads.
        """
        if self.functional or nodes.stop >= len(self.graph.nodes) or not nodes:
            return
        node = self.graph.nodes[nodes.stop - 1]
        if len(node.outputs) == 1 and get_keras_mask(values[node.outputs[0]]) is not None:
            raise TraceError(f"layer {node.scope!r} hands a Keras mask to the next stage, which a list of layers does "
                             "not carry across a cut; build the model on a keras.Input (keras.Sequential([keras.Input("
                             "...), ...]) or the functional API), whose masks cross, or cut after the layer that "
                             "reads the mask")

    def flat_inputs(self, inputs: Any) -> List[Any]:
        """The caller's inputs as one tensor per model input, in ``graph.inputs`` order."""
        if not self.functional:
            return [inputs]
        # Functional's own standardisation: a dict by input names, a single tensor, dtype casts.
        return list(self.model._standardize_inputs(inputs))

    def pack_outputs(self, flat: Sequence[Any]) -> Any:
        """One tensor per ``graph.outputs`` back into the model's output structure, each with its Keras mask."""
        count = len(flat) - len(self.output_masks)
        for t, mask in zip(self.output_masks, flat[count:]):
            set_keras_mask(flat[t], mask)
        flat = flat[:count]
        if not self.functional:
            return flat[0]
        struct = self.model.output
        if isinstance(struct, list) and len(struct) == 1:
            return flat[0]
        return keras.tree.pack_sequence_as(struct, list(flat))

    def bytes_per_sample(self, value: str) -> Optional[int]:
        """Bytes of one sample's ``value`` from its static shape; None when a dimension is unknown."""
        spec = self.specs.get(value)
        if spec is None or any(d is None for d in spec.shape[1:]):
            return None
        return int(np.prod(spec.shape[1:], dtype=np.int64)) * tf.as_dtype(spec.dtype).size


def capture(model: Any) -> KerasGraph:
    """Read a functional ``keras.Model``, a ``keras.Sequential`` or a list of layers into a ``KerasGraph``.

    Raises:
        TraceError: a subclassed model (its ``call`` is Python that cannot be read), or a functional
            model whose inputs are not ``keras.Input`` tensors.
        TypeError: a list holding something that is not a Keras layer.
    """
    if isinstance(model, Functional):
        return _capture_functional(model)
    if isinstance(model, keras.Sequential):
        return _chain(list(model.layers), model)
    if isinstance(model, keras.Model):
        raise TraceError(
            f"{type(model).__name__} is a subclassed keras.Model: its call() is Python code dualframe cannot read "
            "as a graph; build the model with the functional API (keras.Model(inputs, outputs)) or pass a list of "
            "layers, each taking and returning one tensor")
    if isinstance(model, keras.layers.Layer) or isinstance(model, (str, bytes)) or not isinstance(model, Sequence):
        raise TypeError(f"split a functional keras.Model, a keras.Sequential or a list of Keras layers "
                        f"(got {type(model).__name__})")
    for index, layer in enumerate(model):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(f"every layer must be a keras Layer (layers[{index}]: {type(layer).__name__})")
    return _chain(list(model), None)


def _chain(layers: List[Any], model: Optional[Any]) -> KerasGraph:
    """One node per layer, each reading the previous one's output (a layer listed twice: two units).

    A layer whose output had a Keras mask when the Sequential was built on a ``keras.Input`` makes a
    second value, ``<name>~mask``, which the next layer reads beside its input (``chain_masks``).
    """
    nodes, calls, previous, seen = [], [], CHAIN_INPUT, set()
    masked = chain_masks(layers) if model is not None else [False] * len(layers)
    for index, layer in enumerate(layers):
        name = layer.name if layer.name not in seen else f"{layer.name}@{index}"
        unit = name if index == 0 or layers[index - 1].name != layer.name else f"{layer.name}@{index}"
        seen.add(layer.name)
        reads = (previous, f"{previous}~mask") if index and masked[index - 1] else (previous,)
        nodes.append(GraphNode(name, layer.name, reads, (name, f"{name}~mask") if masked[index] else (name,),
                               unit=unit))
        calls.append(Call(layer, masks=((0, 1),) if len(reads) == 2 else (), mask_outputs=(0,) if masked[index] else ()))
        previous = name
    outputs = (previous, f"{previous}~mask") if layers and masked[-1] else (previous,)
    return KerasGraph(Graph((CHAIN_INPUT,), tuple(nodes), outputs), tuple(calls), tuple(layers), model, {}, {},
                      (0,) if len(outputs) == 2 else ())


def _ordered_nodes(model: Any) -> List[Any]:
    """The model's Keras nodes in the order Functional runs them: deepest first, then operation order."""
    op_index = {id(op): k for k, op in enumerate(model.operations)}
    keyed = [(-depth, op_index[id(node.operation)], node.operation._inbound_nodes.index(node), node)
             for depth, nodes in model._nodes_by_depth.items() for node in nodes if node.operation is not None]
    return [entry[-1] for entry in sorted(keyed, key=lambda entry: entry[:3])]


def _capture_functional(model: Any) -> KerasGraph:
    names: Dict[int, str] = {}
    specs: Dict[str, Any] = {}
    inputs = []
    for index, kt in enumerate(model.inputs):
        op = kt._keras_history.operation
        if not isinstance(op, keras.layers.InputLayer):
            raise TraceError(f"model input {index} ({kt.name}) is not a keras.Input: dualframe splits models whose "
                             "inputs are keras.Input tensors")
        names[id(kt)], specs[op.name] = op.name, kt
        inputs.append(op.name)
    ordered = _ordered_nodes(model)
    units = block_units([node.operation for node in ordered])
    calls_of: Dict[int, int] = {}
    for node in ordered:
        calls_of[id(node.operation)] = calls_of.get(id(node.operation), 0) + 1
    seen: Dict[int, int] = {}
    nodes: List[GraphNode] = []
    calls: List[Optional[Call]] = []
    nested: Dict[str, Tuple[str, ...]] = {}
    for node, unit in zip(ordered, units):
        op = node.operation
        if node.is_input:
            nodes.append(GraphNode(op.name, op.name, (), (), unit=unit))
            calls.append(None)
            continue
        c = seen[id(op)] = seen.get(id(op), -1) + 1
        base = op.name if calls_of[id(op)] == 1 else f"{op.name}@{c}"
        keys, reads = [], []
        for kt in node.arguments.keras_tensors:
            if id(kt) not in names:
                raise TraceError(f"layer {op.name!r} reads {kt.name}, which no layer of the model produces "
                                 "(a tensor from outside the model?); make it a model input")
            if id(kt) not in keys:
                keys.append(id(kt))
                reads.append(names[id(kt)])
        masks = mask_reads(node, op.name, names, reads)
        outputs = [base] if len(node.outputs) == 1 else [f"{base}#{t}" for t in range(len(node.outputs))]
        for kt, value in zip(node.outputs, outputs):
            names[id(kt)], specs[value] = value, kt
        made = mask_outputs(node, outputs, names, specs)
        leaf = isinstance(op, keras.Model)
        if leaf:
            nested[op.name] = tuple(layer.name for layer in _layers_inside(op))
        nodes.append(GraphNode(base, op.name, tuple(reads), tuple(outputs), leaf=leaf, unit=unit))
        calls.append(Call(op, node.arguments, tuple(keys), masks, made))
    masked = tuple(t for t, kt in enumerate(model.outputs) if get_keras_mask(kt) is not None)
    outputs = [names[id(kt)] for kt in model.outputs] + [names[id(get_keras_mask(model.outputs[t]))] for t in masked]
    graph = Graph(tuple(inputs), tuple(nodes), tuple(outputs))
    return KerasGraph(graph, tuple(calls), tuple(model.layers), model, specs, nested, masked)


def block_units(operations: Sequence[Any]) -> List[str]:
    """Per node (its operation, in execution order), the unit ``balance=`` counts.

    A layer is its own unit, unless the model is built around a stack of repeated blocks: two or more
    layers of one class that hold layers themselves (keras_hub's ``TransformerDecoder``), each called
    once, with no other layer holding weights between the first and the last. Then the blocks are the
    units: what runs before the first block (inputs, embeddings) joins it, what runs after a block
    (a final norm, a pooler) joins that block, so ``stages=2`` and ``balance=[2, 2]`` cut the stack.
    Nested functional models are never blocks (each stays one unit).

    Example:
        >>> block_units(keras_hub.models.GPT2Backbone(100, 2, 2, 16, 32).operations)   # doctest: +SKIP
        ['transformer_layer_0', ... 'transformer_layer_0', 'transformer_layer_1', 'transformer_layer_1']
    """
    calls: Dict[int, int] = {}
    for op in operations:
        calls[id(op)] = calls.get(id(op), 0) + 1
    by_class: Dict[type, List[int]] = {}
    for k, op in enumerate(operations):
        if calls[id(op)] == 1 and _holds_layers(op):
            by_class.setdefault(type(op), []).append(k)
    blocks = set()
    for found in by_class.values():
        between = range(found[0], found[-1] + 1)
        if len(found) >= 2 and all(k in found or not getattr(operations[k], "weights", ()) for k in between):
            blocks.update(found)
    return units_of([op.name for op in operations], [k in blocks for k in range(len(operations))])


def _holds_layers(op: Any) -> bool:
    if not isinstance(op, keras.layers.Layer) or type(op) in (Functional, keras.Sequential):
        return False
    return any(True for _ in op._flatten_layers(include_self=False, recursive=False))


def _layers_inside(model: Any) -> List[Any]:
    found = []
    for layer in model.layers:
        found.append(layer)
        if isinstance(layer, keras.Model):
            found.extend(_layers_inside(layer))
    return found


def place_variables(layers: Sequence[Any], device: str) -> None:
    """Move the variables of built ``layers`` onto ``device`` (a functional model built them where it ran).

    Keras has no public way to move a built variable: each one's TensorFlow variable is made anew under
    ``tf.device`` with the same value, name and settings (``Variable._initialize``), the Keras variable
    itself (what optimizers, checkpoints and ``model.weights`` hold) stays the same object.
    """
    want = tf.DeviceSpec.from_string(device)
    for layer in layers:
        for variable in layer.weights:
            have = tf.DeviceSpec.from_string(variable.value.device)
            if (have.device_type, have.device_index) != (want.device_type, want.device_index):
                with tf.device(device):
                    variable._initialize(tf.identity(variable.value))


def layers_called_first(captured: KerasGraph, split: Any, j: int) -> List[Any]:
    """The layers stage ``j`` of ``split`` calls before any earlier stage (it holds their variables), in node order."""
    seen = {id(call.operation) for k in range(split.starts[j]) if (call := captured.calls[k]) is not None}
    found: List[Any] = []
    for k in split.stage_range(j):
        call = captured.calls[k]
        if call is not None and id(call.operation) not in seen and isinstance(call.operation, keras.layers.Layer):
            seen.add(id(call.operation))
            found.append(call.operation)
    return found


def layers_called(captured: KerasGraph, split: GraphSplit, j: int) -> List[Any]:
    """Every layer stage ``j`` of ``split`` calls, once each, in node order."""
    found: Dict[int, Any] = {}
    for k in split.stage_range(j):
        call = captured.calls[k]
        if call is not None and isinstance(call.operation, keras.layers.Layer):
            found.setdefault(id(call.operation), call.operation)
    return list(found.values())

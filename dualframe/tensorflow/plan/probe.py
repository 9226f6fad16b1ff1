"""Measure a Keras 3 model for ``dualframe plan`` from a symbolic trace: no activation is allocated.

One training step (forward, loss, ``GradientTape`` gradients) is traced into a TensorFlow graph on a
``tf.TensorSpec`` batch; the tensors the gradient ops read are what the step keeps for backward.
Each top-level layer's ``call`` is wrapped while tracing, so those tensors and the layer's output
shape are attributed to the layer that made them. The layers are the nodes, in the order they ran;
for a functional (graph) model the forward ops' inputs say which values cross from one layer to a
later one (skip connections, masks). A model built around a stack of repeated blocks (a keras_hub
backbone's ``transformer_layer_N``) is merged into one node per block, the units its split counts.
A model with named inputs (a dict: ``token_ids``, ``padding_mask``) is traced with one tensor per
name. Weights are built (Keras has no meta device).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from dualframe.plan.hardware import nvidia_smi_memory  # noqa: E402
from dualframe.pipeline.units import block_units  # noqa: E402
from dualframe.plan.profile import LayerProfile, ModelProfile, Shared, Value  # noqa: E402
from dualframe.plan.units import merge_units  # noqa: E402

#: The trace uses a batch of this many rows and divides, so per-sample figures are exact.
PROBE_BATCH = 2
#: Ops whose outputs are weights or constants, not activations.
_NOT_ACTIVATIONS = ("ReadVariableOp", "Const", "Placeholder", "VarHandleOp")


def top_level_layers(model: Any) -> List[Any]:
    """The layers a ``balance`` counts: the model's layers without its InputLayer."""
    layers = [layer for layer in getattr(model, "layers", []) if not isinstance(layer, keras.layers.InputLayer)]
    return layers or [model]


def _elements(tensor: tf.Tensor) -> float:
    shape = [1 if d is None else int(d) for d in tensor.shape]
    count = float(tf.TensorShape(shape).num_elements() or 0)
    # Non-float tensors (dropout masks, indices) are counted by their bytes in float32 units.
    return count if tensor.dtype.is_floating else count * tensor.dtype.size / 4.0


def _recording(index: int, original: Callable[..., Any], marks: Dict[int, Tuple[int, int, float]]) -> Callable[..., Any]:
    """``original`` (a layer's call) that notes which graph ops it made and its output's size."""

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = tf.compat.v1.get_default_graph()
        start = len(graph.get_operations())
        output = original(*args, **kwargs)
        outputs = [t for t in tf.nest.flatten(output) if isinstance(t, tf.Tensor)]
        marks[index] = (start, len(graph.get_operations()), sum(_elements(t) for t in outputs))
        return output

    return call


def _wrap_calls(layers: Sequence[Any], marks: Dict[int, Tuple[int, int, float]]) -> List[Callable[..., Any]]:
    originals = [layer.call for layer in layers]
    for index, layer in enumerate(layers):
        layer.call = _recording(index, originals[index], marks)
    return originals


def input_specs(model: Any, input_shape: Sequence[int], input_dtype: str, input_names: Sequence[str] = ()) -> Any:
    """The traced batch as the model is called: one ``TensorSpec``, or a dict of them for named inputs.

    A model built on a dict of inputs (keras_hub: ``token_ids``, ``padding_mask``) gets each name
    with ``input_shape`` and the dtype the model declares; ``input_names`` name them otherwise
    (a name with ``mask`` in it is an int32 mask).
    """
    declared = getattr(model, "_inputs_struct", None)
    declared = declared if isinstance(declared, dict) else {}
    names = list(input_names) or list(declared)
    shape = [PROBE_BATCH, *input_shape]
    if not names:
        return tf.TensorSpec(shape, getattr(tf, input_dtype))

    def dtype(name: str) -> Any:
        if name in declared and getattr(declared[name], "dtype", None):
            return tf.as_dtype(declared[name].dtype)
        return tf.int32 if "mask" in name else getattr(tf, input_dtype)

    return {name: tf.TensorSpec(shape, dtype(name)) for name in names}


def _trace(model: Any, spec: Any) -> tf.Graph:
    @tf.function
    def step(batch: Any) -> Any:
        with tf.GradientTape() as tape:
            output = model(batch, training=True)
            loss = tf.add_n([tf.reduce_mean(tf.cast(t, tf.float32)) for t in tf.nest.flatten(output)])
        return tape.gradient(loss, model.trainable_variables)

    return step.get_concrete_function(spec).graph


def _blocks(model: Any, layers: Sequence[Any]) -> List[bool]:
    """Per layer (in run order): is it one of a functional model's stack of repeated blocks?

    As the Keras split counts units (``dualframe.tensorflow.graph.capture.block_units``): two or more layers
    of one class that hold layers, with no other layer holding weights between the first and the
    last. A Sequential is a chain: each layer its own unit.
    """
    found: Dict[type, List[int]] = {}
    for k, layer in enumerate(layers):
        if _holds_layers(layer):
            found.setdefault(type(layer), []).append(k)
    blocks: set = set()
    for ks in found.values():
        between = range(ks[0], ks[-1] + 1)
        if len(ks) >= 2 and all(k in ks or not layers[k].weights for k in between):
            blocks.update(ks)
    chain = isinstance(model, keras.Sequential)
    return [not chain and k in blocks for k in range(len(layers))]


def _holds_layers(layer: Any) -> bool:
    if isinstance(layer, keras.Model):   # a nested model runs whole: never a block
        return False
    return any(True for _ in layer._flatten_layers(include_self=False, recursive=False))


def _saved_by_gradients(graph: tf.Graph) -> Set[str]:
    return {t.name for op in graph.get_operations() if op.name.startswith("gradient_tape/") for t in op.inputs}


def profile_model(model: Any, input_shape: Sequence[int], input_dtype: str = "float32", source: str = "",
                  input_names: Sequence[str] = ()) -> ModelProfile:
    """Profile a built (or buildable) Keras model with one traced training step.

    Args:
        model: a ``keras.Model`` (Sequential or functional); its layers are the nodes, each a place
            where a stage may begin (a split point, named by the layer's name).
        input_shape: one sample's shape (without the batch dimension).
        input_dtype: ``"float32"``, or ``"int32"``/``"int64"`` for token ids.
        source: where the model came from, for the report.
        input_names: named inputs (see ``input_specs``).

    Returns:
        The ModelProfile (per-sample activation elements, parameter counts per layer or block, and
        for a functional model the values between its layers).
    """
    layers = top_level_layers(model)
    marks: Dict[int, Tuple[int, int, float]] = {}
    originals = _wrap_calls(layers, marks)
    try:
        spec = input_specs(model, input_shape, input_dtype, input_names)
        graph = _trace(model, spec)
    finally:
        for layer, original in zip(layers, originals):
            layer.call = original
    saved, operations = _saved_by_gradients(graph), graph.get_operations()
    order = sorted(range(len(layers)), key=lambda index: marks.get(index, (0, 0, 0.0))[0])  # as they ran
    profiles = []
    counts, shared = _weights([layers[index] for index in order])
    for index, (trainable, frozen) in zip(order, counts):
        start, stop, output = marks.get(index, (0, 0, 0.0))
        kept = [_elements(t) / PROBE_BATCH for op in operations[start:stop] if op.type not in _NOT_ACTIVATIONS
                for t in op.outputs if t.name in saved]
        profiles.append(LayerProfile(layers[index].name, trainable, frozen, sum(kept), output / PROBE_BATCH,
                                     max(kept + [output / PROBE_BATCH])))
    elements = float(tf.TensorShape(list(input_shape)).num_elements() or 0) * len(tf.nest.flatten(spec))
    inputs_kept = any(op.type == "Placeholder" and op.outputs[0].name in saved and op.outputs[0].dtype.is_floating
                      for op in operations)
    if inputs_kept:  # the first layer's weight gradient reads the batch itself
        first = profiles[0]
        profiles[0] = LayerProfile(first.name, first.parameters, first.frozen, first.activations + elements,
                                   first.output, first.largest)
    dtype = str(layers[0].dtype_policy.variable_dtype) if hasattr(layers[0], "dtype_policy") else "float32"
    values = _values(operations, [marks.get(index, (0, 0, 0.0))[:2] for index in order])
    if isinstance(model, keras.Sequential) or len(layers) == 1:
        values = []  # a chain: the core derives its values from the outputs
    profile = ModelProfile("keras", source, tuple(input_shape), profiles, elements, dtype, values=values,
                           shared=shared)
    ran = [layers[index] for index in order]
    return merge_units(profile, block_units([layer.name for layer in ran], _blocks(model, ran)))


def _values(operations: Sequence[Any], ranges: Sequence[Tuple[int, int]]) -> List[Value]:
    """The forward values read by a later layer than the one that made them (-1: the model input).

    Ops between layers (the functional model's glue) count with the layer before them.
    """
    starts = {start: j for j, (start, _) in enumerate(ranges)}
    made: Dict[str, Tuple[int, float]] = {}
    last: Dict[str, int] = {}
    current = 0
    for position, op in enumerate(operations):
        current = starts.get(position, current)
        if op.name.startswith("gradient_tape/"):
            continue
        for tensor in op.inputs:
            if tensor.name in made:
                last[tensor.name] = current
        # Placeholders are the batch and the captured variables' handles (resources, not values).
        producer = -1 if op.type == "Placeholder" else current
        if op.type == "Placeholder" or op.type not in _NOT_ACTIVATIONS:
            made.update({t.name: (producer, _elements(t) / PROBE_BATCH) for t in op.outputs
                         if t.dtype not in (tf.resource, tf.variant)})
    return [Value(producer, last[name], elements) for name, (producer, elements) in made.items()
            if last.get(name, producer) > producer and elements > 0]


def _count(weights: Sequence[Any]) -> int:
    return int(sum(int(tf.TensorShape(w.shape).num_elements() or 0) for w in weights))


def _weights(ran: Sequence[Any]) -> Tuple[List[Tuple[int, int]], List[Shared]]:
    """(trainable, frozen) elements per layer in run order, each variable at its first holder, and the shared ones.

    A variable several top-level layers hold (a head reading the embedding's matrix, a layer inside two
    nested models) is counted once and listed as shared: ZeRO-3 frees each layer's values after its
    call, so the plan does not offer it for such a model. One layer called twice holds its variables once.
    """
    holders: Dict[Tuple[int, int], List[int]] = {}  # (kind: 0 trainable / 1 frozen, id) -> positions
    sizes: Dict[Tuple[int, int], int] = {}
    for position, layer in enumerate(ran):
        for kind, weights in enumerate((layer.trainable_weights, layer.non_trainable_weights)):
            for variable in weights:
                holders.setdefault((kind, id(variable)), []).append(position)
                sizes[(kind, id(variable))] = _count([variable])
    counts = [[0, 0] for _ in ran]
    shared = []
    for (kind, key), held in holders.items():
        counts[held[0]][kind] += sizes[(kind, key)]
        if kind == 0 and len(held) > 1:
            shared.append(Shared(sizes[(kind, key)], tuple(held)))
    return [(trainable, frozen) for trainable, frozen in counts], shared


def visible_devices() -> List[Dict[str, Any]]:
    """The GPUs TensorFlow sees, with their memory in bytes from nvidia-smi (empty on a CPU machine)."""
    gpus = tf.config.list_physical_devices("GPU")
    memory = nvidia_smi_memory()
    return [{"name": f"/GPU:{j}", "memory": memory[j] if j < len(memory) else 0} for j in range(len(gpus))]


def profile(target: Any, input_shape: Sequence[int], input_dtype: str = "float32",
            source: str = "", input_names: Sequence[str] = ()) -> Optional[ModelProfile]:
    """Profile a saved model path, a builder or a built model; None if it is not a Keras model."""
    if isinstance(target, (str, os.PathLike)):
        model = keras.saving.load_model(target, compile=False)
    elif callable(target) and not isinstance(target, keras.layers.Layer):
        model = target()
    else:
        model = target
    if not isinstance(model, keras.layers.Layer):
        return None
    return profile_model(model, input_shape, input_dtype, source, input_names)

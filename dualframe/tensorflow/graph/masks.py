"""Keras's implicit masks as values of a captured graph: which node reads or makes one, so that a cut sends it.

Keras hands a mask (``Embedding(mask_zero=True)``, a layer with ``supports_masking``) from layer to
layer as an attribute of the tensor (``_keras_mask``); a layer taking ``mask=`` has it recorded in its
call, others (``MultiHeadAttention``, a Keras loss) read it from the tensor. A copy onto another device,
a message between processes or a compiled function's argument does not keep the attribute, so the
capture (``dualframe.tensorflow.graph.capture``) makes each mask a value of the graph, read beside its tensor.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import keras

# Keras has no public getter for the implicit mask a layer sets on its output tensor (the _keras_mask attribute).
from keras.src.backend.common.masking import get_keras_mask

from dualframe.errors import TraceError


def mask_reads(node: Any, layer: str, names: Dict[int, str], reads: List[str]) -> Tuple[Tuple[int, int], ...]:
    """Per argument of ``node`` that had an implicit Keras mask at build, (its position, its mask's) in ``reads``.

    The mask's value joins ``reads`` (unless the node reads it already, as an LSTM's ``mask=``), so a cut
    sends it beside the tensor to the stage that reads them.
    """
    pairs = []
    for kt in node.arguments.keras_tensors:
        mask = get_keras_mask(kt)
        if mask is None:
            continue
        if id(mask) not in names:
            raise TraceError(f"layer {layer!r} reads {kt.name} with a Keras mask that no layer of the model makes; "
                             "pass the mask as a model input")
        if names[id(mask)] not in reads:
            reads.append(names[id(mask)])
        pair = (reads.index(names[id(kt)]), reads.index(names[id(mask)]))
        if pair not in pairs:
            pairs.append(pair)
    return tuple(pairs)


def mask_outputs(node: Any, outputs: List[str], names: Dict[int, str], specs: Dict[str, Any]) -> Tuple[int, ...]:
    """The outputs of ``node`` whose Keras mask is new (not an earlier value's): each gets a value ``<output>~mask``."""
    found = []
    for t, kt in enumerate(node.outputs):
        mask = get_keras_mask(kt)
        if mask is not None and id(mask) not in names:
            value = f"{outputs[t]}~mask"
            names[id(mask)], specs[value] = value, mask
            outputs.append(value)
            found.append(t)
    return tuple(found)


def chain_masks(layers: Sequence[Any]) -> List[Optional[bool]]:
    """Per layer of a chain, whether its output has a Keras mask; None where unknown (not built on a ``keras.Input``)."""
    found: List[Optional[bool]] = []
    for layer in layers:
        try:
            found.append(get_keras_mask(layer.output) is not None)
        except (AttributeError, ValueError):  # never called on a keras.Input, or called several times
            found.append(None)
    return found


def chain_mask_crossing(layers: Sequence[Any], stops: Sequence[int]) -> Optional[Tuple[str, str]]:
    """Where a cut of a chain before ``layers[stop]`` (each of ``stops``) may drop a Keras mask: (the layer, why).

    Known outputs (a Sequential built on a ``keras.Input``) say it; otherwise any mask source before the
    cut (an ``Embedding(mask_zero=True)``, a ``Masking``) counts, since where its mask ends is unknown.

    Example:
        >>> chain_mask_crossing([keras.layers.Embedding(9, 4, mask_zero=True), keras.layers.LSTM(4)], [1])
        ('embedding', 'makes a Keras mask that may still be on the tensor there')
    """
    masked = chain_masks(layers)
    for stop in stops:
        if masked[stop - 1]:
            return layers[stop - 1].name, "hands a Keras mask to the next stage"
        if masked[stop - 1] is None:
            for layer in layers[:stop]:
                if isinstance(layer, keras.layers.Masking) or getattr(layer, "mask_zero", False):
                    return layer.name, "makes a Keras mask that may still be on the tensor there"
    return None

"""Whether a Keras process stage's compiled passes use XLA: asked for, or chosen per stage where it pays back.

Measured on the CPU (docs/benchmarks.md, ``scripts/bench_first_steps_tf.py``): a stage of ``Dense``
layers pays XLA's compilation back within a few steps (its kernels keep their speed per row at
micro-batch sizes); a convolution stage (ResNet50: 16.6 s against 7.1 s for the first step, and
slower steps after) or a keras_hub transformer stage (7.2 s against 2.3 s, steps no faster) does not.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, Sequence

import keras
import tensorflow as tf

_LOG = logging.getLogger(__name__)


def _inner_layers(layers: Sequence[Any]) -> Iterator[Any]:
    for stage_layer in layers:
        # A graph stage (distributed_graph.GraphStage) is a plain holder of its Keras layers.
        held = stage_layer.layers if not isinstance(stage_layer, keras.layers.Layer) else [stage_layer]
        for layer in held:
            yield from layer._flatten_layers(include_self=True, recursive=True)


def draws_random_numbers(layers: Sequence[Any]) -> bool:
    """Whether a stage holds a layer with a Keras seed generator (Dropout, GaussianNoise, random augmentation ...).

    Under XLA, TensorFlow's stateless random ops pick another algorithm than on the CPU, so a Dropout
    mask would differ from the one process's and the pipeline would no longer equal it: such a stage
    runs as a plain ``tf.function``.
    """
    for inner in _inner_layers(layers):
        if isinstance(getattr(inner, "seed_generator", None), keras.random.SeedGenerator):
            _LOG.info("stage layer %s draws random numbers: compiled without XLA so its random stream is "
                      "TensorFlow's CPU one, as in one process", inner.name)
            return True
    return False


def pays_back(layers: Sequence[Any], device: Optional[str]) -> bool:
    """``jit_compile=None``: XLA on a GPU (as Keras's ``fit`` decides); on a CPU, for a stage of ``Dense`` weights only."""
    on_gpu = "GPU" in device.upper() if device else bool(tf.config.list_logical_devices("GPU"))
    if on_gpu:
        return True
    return all(isinstance(inner, keras.layers.Dense) or not _holds_weights(inner) for inner in _inner_layers(layers))


def _holds_weights(layer: Any) -> bool:
    """Whether the layer makes variables of its own (not its sublayers'); unbuilt: whether it has a ``build``."""
    if layer.built:
        return bool(layer._trainable_variables or layer._non_trainable_variables)
    return type(layer).build is not keras.layers.Layer.build


def use_xla(jit_compile: Optional[bool], layers: Sequence[Any], device: Optional[str]) -> bool:
    """Whether the stage's passes compile with XLA: ``jit_compile`` if given (None: ``pays_back``), never with random layers.

    Example:
        >>> use_xla(None, [keras.layers.Conv2D(4, 3)], "/CPU:0")
        False
    """
    wanted = pays_back(layers, device) if jit_compile is None else jit_compile
    return wanted and not draws_random_numbers(layers)

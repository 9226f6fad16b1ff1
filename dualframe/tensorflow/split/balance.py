"""Balance helpers for Keras 3: split layers evenly by parameter size or by measured time."""
from __future__ import annotations

import statistics
import time
from typing import List, Sequence

import keras
import tensorflow as tf

from dualframe.pipeline.partition import balance_by_cost


def balance_by_size(layers: Sequence[keras.layers.Layer], partitions: int) -> List[int]:
    """Balance whose groups hold about the same parameter bytes; the layers must be built.

    Example:
        >>> balance_by_size(built_layers, 2)   # doctest: +SKIP
        [1, 2]
    """
    costs = []
    for index, layer in enumerate(layers):
        if not layer.built:
            raise ValueError(f"layers must be built to count their parameters (layers[{index}]: {layer.name}); "
                             f"call the model on a sample batch first or use balance_by_time")
        costs.append(float(sum(int(tf.size(w.value)) * tf.as_dtype(w.dtype).size for w in layer.weights)))
    return balance_by_cost(costs, partitions)


def layer_times(layers: Sequence[keras.layers.Layer], sample: tf.Tensor, repeats: int = 3) -> List[float]:
    """Median seconds of forward + backward of each layer on ``sample`` (eager, layer by layer)."""
    times: List[List[float]] = [[] for _ in layers]
    for repeat in range(repeats + 1):  # the first pass warms up (allocations, kernels) and is not counted
        x = tf.convert_to_tensor(sample)
        for index, layer in enumerate(layers):
            start = time.perf_counter()
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
            grads = tape.gradient(y, [x] + list(layer.trainable_variables))
            _ = [g.numpy() for g in grads if g is not None]  # wait for the work
            if repeat:
                times[index].append(time.perf_counter() - start)
            x = tf.stop_gradient(y)
    return [statistics.median(t) for t in times]


def balance_by_time(layers: Sequence[keras.layers.Layer], sample: tf.Tensor, partitions: int,
                    repeats: int = 3) -> List[int]:
    """Balance whose groups take about the same measured time on ``sample`` (forward + backward).

    Example:
        >>> layers = [keras.layers.Dense(256) for _ in range(8)]
        >>> balance = balance_by_time(layers, tf.random.normal((64, 256)), partitions=2)  # doctest: +SKIP
    """
    return balance_by_cost(layer_times(layers, sample, repeats), partitions)

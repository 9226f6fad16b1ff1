"""One TensorFlow pipeline stage's work on micro-batches (the core's StageWork): a GradientTape per micro-batch."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf


class TFStageWork:
    """Forward and backward of one stage's layers on micro-batch i, keeping its tape until backward runs.

    Forward records micro-batch i under its own ``tf.GradientTape`` (watching the received input),
    through ``compiled`` (the stage's layers in one ``tf.function``) when given and the layers are built;
    backward asks that tape for the gradients of the stage's variables and of its input, given the
    output's gradient from the next stage. The last stage turns each output into its loss, weighted
    by the micro-batch's share of rows, so the summed gradients are those of the mini-batch's mean loss.

    Example:
        >>> work = TFStageWork(layers, True, True, loss, [y0], [1.0])   # doctest: +SKIP
        >>> work.forward(0, x0); work.backward(0, None); work.gradients            # doctest: +SKIP
    """

    def __init__(self, layers: Sequence[Any], first: bool, last: bool, loss_fn: Optional[Callable[[Any, Any], Any]], targets: List[tf.Tensor], weights: List[float],
                 device: Optional[str] = None, compiled: Optional[Callable[[tf.Tensor, bool], tf.Tensor]] = None) -> None:
        self.layers, self.first, self.last = list(layers), first, last
        self.compiled = compiled
        self.loss_fn, self.targets, self.weights, self.device = loss_fn, targets, weights, device
        self._saved: Dict[int, Tuple[tf.GradientTape, tf.Tensor, tf.Tensor]] = {}
        self.variables: List[tf.Variable] = []  # read at the first backward: unbuilt layers build in forward
        self.gradients: List[Optional[tf.Tensor]] = []
        self.outputs: List[tf.Tensor] = []
        self.loss_sum = 0.0
        self.peak_live = 0  # most micro-batches whose tapes were alive at once

    def _run(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        # The compiled stage (a tf.function the tape records as one op) once every layer is built:
        # eager Keras pays per op, which made 8 micro-batches cost 1.43x one batch (docs/benchmarks.md).
        if self.compiled is not None and all(layer.built for layer in self.layers):
            return self.compiled(x, training)
        for layer in self.layers:
            x = layer(x, training=training)
        return x

    def forward(self, i: int, x: tf.Tensor) -> Optional[tf.Tensor]:
        training = self.loss_fn is not None
        with tf.device(self.device):
            if not training:
                y = self._run(x, training=False)
                if self.last:
                    self.outputs.append(y)
                return None if self.last else y
            with tf.GradientTape() as tape:
                if not self.first:
                    tape.watch(x)
                y = self._run(x, training=True)
                if self.last:
                    assert self.loss_fn is not None
                    y = tf.reduce_mean(self.loss_fn(self.targets[i], y)) * self.weights[i]
        self._saved[i] = (tape, x, y)
        self.peak_live = max(self.peak_live, len(self._saved))
        if self.last:
            self.loss_sum += float(y)
            return None
        return y

    def backward(self, i: int, grad: Optional[tf.Tensor]) -> Optional[tf.Tensor]:
        tape, x, y = self._saved.pop(i)
        if not self.gradients:
            self.variables = [v for layer in self.layers for v in layer.trainable_weights]
            self.gradients = [None] * len(self.variables)
        sources = self.variables + ([] if self.first else [x])
        with tf.device(self.device):
            grads = tape.gradient(y, sources, output_gradients=None if self.last else grad)
            for index, g in enumerate(grads[:len(self.variables)]):
                if g is not None:
                    g = tf.convert_to_tensor(g)  # IndexedSlices (embeddings) made dense for the sum
                    previous = self.gradients[index]
                    self.gradients[index] = g if previous is None else previous + g
        if self.first:
            return None
        input_grad = grads[-1]
        return tf.zeros_like(x) if input_grad is None else tf.convert_to_tensor(input_grad)

"""A Keras stage's backward in two compiled passes, for zero-bubble schedules: the input's gradient now, the weights' later.

A zero-bubble schedule (``"zb-h1"``) runs ``B i``, the gradient of the stage's input that the previous
stage waits for, as soon as it can, and ``W i``, the gradient of the stage's weights, later in ticks
that would otherwise be idle. TensorFlow cannot keep a tape across two compiled (XLA) calls, and the
tape's gradient of a compiled call runs that call's whole backward whatever was asked (the input's
gradient alone costs as much as all of them), so a persistent tape gives no split. Instead:

* ``F i`` (``forward_inputs``): the stage's layers, returning their output *and every layer's input*
  (what a tape would keep, about the same bytes);
* ``B i`` (``input_pass``): layer by layer from the last, each layer re-run from its kept input under
  a tape that asks only for the input's gradient, keeping the gradient at the output of every layer
  that owns weights. XLA drops what that gradient does not need: a ``Dense`` (without activation) is
  linear, so its re-run product is dead code and only ``dy @ W.T`` runs; an activation layer re-runs
  its elementwise op. A layer whose input's gradient needs its own output (a ``Dense(activation=...)``)
  re-runs its product: write the activation as its own layer to avoid it;
* ``W i`` (``weight_pass``): per layer that owns weights, its weights' gradient from its kept input
  and B's output gradient (for a ``Dense``: ``x.T @ dy`` and the bias sum, the re-run product dead
  code again), added to the step's sums in the same call.

On the last stage ``F i`` and ``B i`` are one call (``last_input_pass``: forward, loss, the input's
gradient and the kept output gradients, no weight product), since zero-bubble schedules run them back
to back there. GPipe runs its W passes together after its last B (``batched_weight_pass``, see
``dualframe.pipeline.schedule.batched_weights``). Re-running a layer is exact only for a layer without state: a
stage with a layer that has non-trainable variables (``BatchNormalization``'s moving statistics,
``Dropout``'s seed) is not ``splittable`` and runs B as a full backward (W then only adds that
gradient: no gain, logged once).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

Gradients = List[Optional[tf.Tensor]]


def splittable(layers: Sequence[Any]) -> bool:
    """Whether re-running each layer from its input gives the forward's values (no layer with state).

    Example:
        >>> splittable([keras.layers.Dense(4), keras.layers.ReLU()]), splittable([keras.layers.Dropout(0.1)])  # doctest: +SKIP
        (True, False)
    """
    return all(not layer.non_trainable_variables for layer in layers)


def reruns_cheaply(layers: Sequence[Any]) -> bool:
    """Whether each layer that owns weights owns them itself (a ``Dense``), none through sublayers (a transformer block).

    B re-runs every layer and W every owner: for a ``Dense`` the re-run product is dead code, but a
    block with weighted sublayers re-runs its whole forward in B and again in W (its weights' gradient
    needs its whole backward). A ``keras_hub.layers.TransformerEncoder`` stage split so computed 1.5x
    the taped step (``scripts/bench_stage_cpu_tf.py``), so GPipe does not batch its W passes there.

    Example:
        >>> reruns_cheaply([keras.layers.Dense(4), keras.layers.ReLU()])  # doctest: +SKIP
        True
    """
    return not any(inner.trainable_weights for layer in layers if layer.trainable_weights
                   for inner in layer._flatten_layers(include_self=False, recursive=True))


def _gradient_or_zeros(gradient: Any, like: tf.Tensor) -> tf.Tensor:
    return tf.zeros_like(like) if gradient is None else tf.convert_to_tensor(gradient)


class SplitFunctions:
    """The python bodies of one stage's split passes (compiled by ``StageFunctions``).

    Example:
        >>> split = SplitFunctions(layers, first=False, loss_fn=None)                  # doctest: +SKIP
        >>> y, inputs = split.forward_inputs(x)                                        # doctest: +SKIP
        >>> grad_x, kept = split.input_pass(inputs, grad_y)                            # doctest: +SKIP
        >>> sums = split.weight_pass(inputs, kept, None)                               # doctest: +SKIP
    """

    def __init__(self, layers: Sequence[Any], first: bool, loss_fn: Optional[Callable[[Any, Any], Any]]) -> None:
        self.layers, self.first, self.loss_fn = list(layers), first, loss_fn
        #: Positions of the layers that own weights (W's layers), in forward order.
        self.owners = [k for k, layer in enumerate(self.layers) if layer.trainable_weights]

    def forward_inputs(self, x: tf.Tensor) -> Tuple[tf.Tensor, List[tf.Tensor]]:
        """F: the stage's output and each layer's input (the first is ``x``)."""
        inputs = []
        for layer in self.layers:
            inputs.append(x)
            x = layer(x, training=True)
        return x, inputs

    def input_pass(self, inputs: List[tf.Tensor], grad: tf.Tensor) -> Tuple[Optional[tf.Tensor], List[tf.Tensor]]:
        """B: the input's gradient (None on the first stage) and the gradient at each owner's output."""
        kept: List[tf.Tensor] = []
        for k in reversed(range(len(self.layers))):
            if k in self.owners:
                kept.append(grad)
            if k == 0 and self.first:
                return None, kept[::-1]
            with tf.GradientTape() as tape:
                tape.watch(inputs[k])
                y = self.layers[k](inputs[k], training=True)
            grad = _gradient_or_zeros(tape.gradient(y, inputs[k], output_gradients=grad), inputs[k])
        return grad, kept[::-1]

    def last_input_pass(self, x: tf.Tensor, target: tf.Tensor, weight: tf.Tensor
                        ) -> Tuple[tf.Tensor, Optional[tf.Tensor], List[tf.Tensor], List[tf.Tensor]]:
        """F and B of the last stage in one: weighted loss, input's gradient, owners' inputs and output gradients."""
        assert self.loss_fn is not None
        inputs, outputs = [], []
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for layer in self.layers:
                inputs.append(y)
                y = layer(y, training=True)
                outputs.append(y)
            loss = tf.reduce_mean(self.loss_fn(target, y))
            loss = loss * tf.cast(weight, loss.dtype)
        sources = ([] if self.first else [x]) + [outputs[k] for k in self.owners]
        found = tape.gradient(loss, sources)
        grad_x = None if self.first else _gradient_or_zeros(found[0], x)
        kept = [_gradient_or_zeros(g, outputs[k]) for g, k in zip(found[0 if self.first else 1:], self.owners)]
        return loss, grad_x, [inputs[k] for k in self.owners], kept

    def last_forward_inputs(self, x: tf.Tensor, target: tf.Tensor, weight: tf.Tensor
                            ) -> Tuple[tf.Tensor, List[tf.Tensor], tf.Tensor]:
        """F of the last stage alone: weighted loss, each layer's input, and the loss's gradient at the output.

        ``input_pass(inputs, output_gradient)`` is its B later (GPipe's, whose last stage runs B's after
        all F's); only the loss's own derivative runs here, no layer's backward.
        """
        assert self.loss_fn is not None
        y, inputs = self.forward_inputs(x)
        with tf.GradientTape() as tape:
            tape.watch(y)
            loss = tf.reduce_mean(self.loss_fn(target, y))
            loss = loss * tf.cast(weight, loss.dtype)
        return loss, inputs, _gradient_or_zeros(tape.gradient(loss, y), y)

    def weight_pass(self, inputs: List[tf.Tensor], kept: List[tf.Tensor], sums: Optional[Gradients]) -> Gradients:
        """W: each owner's weights' gradient from its input and B's output gradient, added to ``sums``.

        ``inputs`` holds the owners' inputs only (``owner_inputs`` picks them from F's list).
        """
        gradients: Gradients = []
        for k, x, grad in zip(self.owners, inputs, kept):
            layer = self.layers[k]
            with tf.GradientTape() as tape:
                y = layer(x, training=True)
            found = tape.gradient(y, layer.trainable_weights, output_gradients=grad)
            gradients += [None if g is None else tf.convert_to_tensor(g) for g in found]
        if sums is None:
            return gradients
        return [a if b is None else b if a is None else a + b for a, b in zip(sums, gradients)]

    def batched_weight_pass(self, inputs: Sequence[List[tf.Tensor]], kept: Sequence[List[tf.Tensor]],
                            sums: Optional[Gradients]) -> Gradients:
        """W of several micro-batches at once: their owners' inputs and output gradients concatenated by rows.

        A weight's gradient is a sum over rows (``x.T @ dy`` for a ``Dense``), so one pass over the rows
        of every micro-batch gives the sum of their W passes, as one product of the mini-batch's rows:
        TensorFlow's CPU matmul is faster per row there than at micro-batch sizes.
        ``inputs[i]``, ``kept[i]``: micro-batch i's ``owner_inputs`` and B's output gradients.
        """
        if len(inputs) == 1:
            return self.weight_pass(inputs[0], kept[0], sums)
        joined_inputs = [tf.concat(list(parts), 0) for parts in zip(*inputs)]
        joined_kept = [tf.concat(list(parts), 0) for parts in zip(*kept)]
        return self.weight_pass(joined_inputs, joined_kept, sums)

    def owner_inputs(self, inputs: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        """The inputs of the layers that own weights, from F's list of every layer's input."""
        return [inputs[k] for k in self.owners]

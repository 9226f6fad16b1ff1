"""One TensorFlow pipeline stage's work on micro-batches (the core's StageWork): compiled stage functions, a tape per micro-batch where one must outlive the call."""
from __future__ import annotations

from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

Gradients = List[Optional[tf.Tensor]]


def _stage_variables(layers: Sequence[Any]) -> List[tf.Variable]:
    return [v for layer in layers for v in layer.trainable_weights]


def _dense(gradients: Sequence[Any]) -> Gradients:
    # IndexedSlices (embeddings) made dense, so a step's micro-batches sum with one add.
    return [None if g is None else tf.convert_to_tensor(g) for g in gradients]


class StageFunctions:
    """The compiled functions of one stage, made once per pipeline so their traces live across steps.

    * ``forward(x, training)``: the stage's layers in one ``tf.function`` (a tape records the call as one op);
    * ``last_step(x, target, weight)``: the last stage's whole micro-batch in one ``tf.function``: forward,
      weighted loss, and the gradients of the loss for the stage's variables and its input. The last
      stage needs no gradient from a neighbour, so its backward can run in the same compiled call as
      its forward: one call instead of a forward with side outputs, a tape and a backward call (what
      made 8 taped micro-batches cost 1.2-1.8x one batch, docs/benchmarks.md);
    * ``accumulate(sums, gradients)``: a step's gradient sums in one call instead of one eager add each.

    All trace once per (relaxed) input shape; they are used only once every layer is built (variables
    can be created in a ``tf.function``'s first trace only), before that the stage runs eagerly.

    Example:
        >>> functions = StageFunctions(layers, first=False, loss_fn=keras.losses.get("mse"))  # doctest: +SKIP
        >>> loss, gradients, input_gradient = functions.last_step(x, y, tf.constant(0.25))    # doctest: +SKIP
    """

    def __init__(self, layers: Sequence[Any], first: bool, loss_fn: Optional[Callable[[Any, Any], Any]]) -> None:
        self.layers, self.first, self.loss_fn = list(layers), first, loss_fn
        self.forward = tf.function(self._forward, reduce_retracing=True)
        self.last_step = tf.function(self._last_step, reduce_retracing=True)
        self.accumulate = tf.function(self._accumulate, reduce_retracing=True)

    def ready(self) -> bool:
        """Whether every layer is built (the compiled functions may run)."""
        return all(layer.built for layer in self.layers)

    def _forward(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        for layer in self.layers:
            x = layer(x, training=training)
        return x

    def _last_step(self, x: tf.Tensor, target: tf.Tensor, weight: tf.Tensor) -> Tuple[tf.Tensor, Gradients, Optional[tf.Tensor]]:
        assert self.loss_fn is not None
        with tf.GradientTape() as tape:
            if not self.first:
                tape.watch(x)
            loss = tf.reduce_mean(self.loss_fn(target, self._forward(x, True)))
            loss = loss * tf.cast(weight, loss.dtype)
        variables = _stage_variables(self.layers)
        gradients = _dense(tape.gradient(loss, variables + ([] if self.first else [x])))
        if self.first:
            return loss, gradients, None
        input_gradient = gradients.pop()
        return loss, gradients, tf.zeros_like(x) if input_gradient is None else input_gradient

    @staticmethod
    def _accumulate(sums: List[tf.Tensor], gradients: List[tf.Tensor]) -> List[tf.Tensor]:
        return [a + b for a, b in zip(sums, gradients)]


def fusable(plan: Sequence[Any]) -> List[int]:
    """Micro-batches whose backward directly follows their forward in ``plan`` (Actions or ``"F3"``-like strings).

    Example:
        >>> fusable(["F0", "F1", "B1", "B0"]), fusable(["F0", "B0", "F1", "B1"])
        ([1], [0, 1])
    """
    tags = [str(action) for action in plan]
    return [int(a[1:]) for a, b in zip(tags, tags[1:]) if a[0] == "F" and b == "B" + a[1:]]


class TFStageWork:
    """Forward and backward of one stage's layers on micro-batch i.

    On stages before the last, forward records micro-batch i under its own ``tf.GradientTape``
    (watching the received input) through ``functions.forward``, and keeps the tape until backward
    asks it for the gradients of the stage's variables and input, given the output's gradient from
    the next stage. On the last stage, a micro-batch whose backward directly follows its forward in
    the schedule (``fused``: all with 1F1B, the last one with GPipe) runs forward, loss and backward
    in one compiled call at forward time (``StageFunctions.last_step``), keeping only its input's
    gradient until the backward sends it; the others are taped, so that GPipe's backward messages
    still flow one by one while the first stages compute. The loss is weighted by the micro-batch's share of rows, so the
    summed gradients are those of the mini-batch's mean loss. Before the layers are built, every
    stage runs eagerly under a tape.

    Example:
        >>> work = TFStageWork(layers, True, True, loss, [y0], [1.0], fused={0})   # doctest: +SKIP
        >>> work.forward(0, x0); work.backward(0, None); work.gradients            # doctest: +SKIP
    """

    def __init__(self, layers: Sequence[Any], first: bool, last: bool, loss_fn: Optional[Callable[[Any, Any], Any]], targets: List[tf.Tensor], weights: List[float],
                 device: Optional[str] = None, functions: Optional[StageFunctions] = None,
                 fused: Collection[int] = ()) -> None:
        self.layers, self.first, self.last = list(layers), first, last
        self.functions = functions if functions is not None and functions.ready() else None
        self.fused = set(fused) if last else set()
        self.loss_fn, self.targets, self.weights, self.device = loss_fn, targets, weights, device
        self._saved: Dict[int, Any] = {}  # i -> (tape, input, output), or the last stage's input gradient
        self.variables: List[tf.Variable] = []  # read at the first gradients: unbuilt layers build in forward
        self.gradients: Gradients = []
        self.outputs: List[tf.Tensor] = []
        self.loss_sum = 0.0
        self.peak_live = 0  # most micro-batches held (tapes, or input gradients on the last stage) at once

    def _run(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        if self.functions is not None:
            return self.functions.forward(x, training)
        for layer in self.layers:
            x = layer(x, training=training)
        return x

    def _keep(self, i: int, saved: Any) -> None:
        self._saved[i] = saved
        self.peak_live = max(self.peak_live, len(self._saved))

    def _add(self, gradients: Sequence[Any]) -> None:
        """Add one micro-batch's variable gradients to the step's sums (None: not connected to the loss)."""
        if not self.gradients:
            self.variables = _stage_variables(self.layers)
            self.gradients = [None] * len(self.variables)
        new = _dense(gradients)
        both = [index for index, g in enumerate(new) if g is not None and self.gradients[index] is not None]
        if both and self.functions is not None:
            sums = self.functions.accumulate([self.gradients[k] for k in both], [new[k] for k in both])
        else:
            sums = [self.gradients[k] + new[k] for k in both]  # type: ignore[operator]
        for k, g in enumerate(new):
            if g is not None and self.gradients[k] is None:
                self.gradients[k] = g
        for k, total in zip(both, sums):
            self.gradients[k] = total

    def forward(self, i: int, x: tf.Tensor) -> Optional[tf.Tensor]:
        training = self.loss_fn is not None
        with tf.device(self.device):
            if not training:
                y = self._run(x, training=False)
                if self.last:
                    self.outputs.append(y)
                return None if self.last else y
            if i in self.fused and self.functions is not None:
                self._last_step(i, x)
                return None
            with tf.GradientTape() as tape:
                if not self.first:
                    tape.watch(x)
                y = self._run(x, training=True)
                if self.last:
                    assert self.loss_fn is not None
                    y = tf.reduce_mean(self.loss_fn(self.targets[i], y)) * self.weights[i]
        self._keep(i, (tape, x, y))
        if self.last:
            self.loss_sum += float(y)
            return None
        return y

    def _last_step(self, i: int, x: tf.Tensor) -> None:
        assert self.functions is not None
        loss, gradients, input_gradient = self.functions.last_step(x, self.targets[i], tf.constant(self.weights[i], tf.float64))
        self._add(gradients)
        self._keep(i, input_gradient)
        self.loss_sum += float(loss)

    def backward(self, i: int, grad: Optional[tf.Tensor]) -> Optional[tf.Tensor]:
        saved = self._saved.pop(i)
        if not isinstance(saved, tuple):  # the last stage's compiled step already ran: its input's gradient
            return saved
        tape, x, y = saved
        variables = _stage_variables(self.layers)
        with tf.device(self.device):
            grads = tape.gradient(y, variables + ([] if self.first else [x]),
                                  output_gradients=None if self.last else grad)
            self._add(grads[:len(variables)])
        if self.first:
            return None
        input_grad = grads[-1]
        return tf.zeros_like(x) if input_grad is None else tf.convert_to_tensor(input_grad)

"""One TensorFlow pipeline stage's work on micro-batches (the core's StageWork): compiled stage functions, a tape per micro-batch where one must outlive the call."""
from __future__ import annotations

import logging
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dualframe.pipeline.action import fusable  # noqa: F401 (which micro-batches the last stage fuses)
from dualframe.pipeline.schedule import deferred_weights  # noqa: F401 (the W order batch_weights runs)
from dualframe.tensorflow.pipeline.backward import SplitFunctions, reruns_cheaply, splittable
from dualframe.tensorflow.pipeline.compiled import CompiledPass as _Compiled, Gradients, dense as _dense, summed as _summed
from dualframe.tensorflow.pipeline.recompute import StageRecompute

_LOG = logging.getLogger(__name__)
_WARNED: List[bool] = []  # the no-split warning, once per process


def _stage_variables(layers: Sequence[Any]) -> List[tf.Variable]:
    return [v for layer in layers for v in layer.trainable_weights]


class StageFunctions:
    """The compiled functions of one stage, made once per pipeline so their traces live across steps.

    One compiled call per micro-batch and pass, everything of that pass inside it:

    * ``forward(x, training)``: the stage's layers (a tape records the call as one op; its backward
      is one compiled call too);
    * ``forward_loss(x, target, weight)``: the last stage's layers and weighted loss, taped the same way;
    * ``last_step(x, target, weight, sums)``: the last stage's whole micro-batch: forward, weighted
      loss, the gradients of the loss for the stage's variables, added to ``sums`` (the step's sums
      so far, None for the first), and its input's gradient. The last stage needs no gradient from a
      neighbour, so its backward can run in the same compiled call as its forward;
    * ``accumulate(sums, gradients)``: a taped micro-batch's gradients added to the step's sums in one call;
    * ``forward_inputs``, ``input_pass``, ``last_input_pass``, ``weight_pass``: the split backward's
      F, B, F+B of the last stage, and W (``dualframe.tensorflow.pipeline.backward``), for zero-bubble
      schedules on a ``splittable`` stage; ``last_forward_inputs`` (the last stage's F alone) and
      ``batched_weight_pass`` (the W of every micro-batch of a step in one pass over their rows,
      compiled without XLA) for GPipe's ``schedule.deferred_weights``.

    Each is compiled with XLA (``jit_compile``, see ``_Compiled``) and traced once per (relaxed) input
    shape and per first-or-not; they are used only once every layer is built (variables can be
    created in a ``tf.function``'s first trace only), before that the stage runs eagerly.

    Example:
        >>> functions = StageFunctions(layers, first=False, loss_fn=keras.losses.get("mse"))          # doctest: +SKIP
        >>> loss, sums, input_gradient = functions.last_step(x, y, tf.constant(0.25, tf.float64), None)  # doctest: +SKIP
    """

    def __init__(self, layers: Sequence[Any], first: bool, loss_fn: Optional[Callable[[Any, Any], Any]],
                 jit_compile: bool = True) -> None:
        self.layers, self.first, self.loss_fn = list(layers), first, loss_fn
        self.forward = _Compiled(self._forward, jit_compile)
        self.forward_loss = _Compiled(self._forward_loss, jit_compile)
        self.last_step = _Compiled(self._last_step, jit_compile)
        self.accumulate = _Compiled(_summed, jit_compile)
        self.split = SplitFunctions(self.layers, first, loss_fn)
        self.forward_inputs = _Compiled(self.split.forward_inputs, jit_compile)
        self.input_pass = _Compiled(self.split.input_pass, jit_compile)
        self.last_input_pass = _Compiled(self.split.last_input_pass, jit_compile)
        self.weight_pass = _Compiled(self.split.weight_pass, jit_compile)
        self.last_forward_inputs = _Compiled(self.split.last_forward_inputs, jit_compile)
        # Without XLA: at the mini-batch's rows TensorFlow's own matmul is faster than XLA's on the CPU
        # (W of the benchmark's stage, 2048 rows: 0.15 s against 0.19 s; docs/benchmarks.md).
        self.batched_weight_pass = _Compiled(self.split.batched_weight_pass, False)

    def ready(self) -> bool:
        """Whether every layer is built (the compiled functions may run)."""
        return all(layer.built for layer in self.layers)

    def splittable(self) -> bool:
        """Whether B and W may run as separate compiled passes (built, and no layer with state)."""
        return self.ready() and splittable(self.layers)

    def batches_weights(self) -> bool:
        """Whether GPipe's W passes pay as one batched pass: ``splittable`` and ``reruns_cheaply`` (no re-run blocks)."""
        return self.splittable() and reruns_cheaply(self.layers)

    def tracing_counts(self) -> Dict[str, int]:
        """Traces per function so far (a test checks that no step after the first traces again)."""
        return {name: getattr(self, name).tracing_count()
                for name in ("forward", "forward_loss", "last_step", "accumulate", "forward_inputs",
                             "input_pass", "last_input_pass", "weight_pass", "last_forward_inputs",
                             "batched_weight_pass")}

    def _forward(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        for layer in self.layers:
            x = layer(x, training=training)
        return x

    def _forward_loss(self, x: tf.Tensor, target: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
        assert self.loss_fn is not None
        loss = tf.reduce_mean(self.loss_fn(target, self._forward(x, True)))
        return loss * tf.cast(weight, loss.dtype)

    def _last_step(self, x: tf.Tensor, target: tf.Tensor, weight: tf.Tensor,
                   sums: Optional[Gradients]) -> Tuple[tf.Tensor, Gradients, Optional[tf.Tensor]]:
        with tf.GradientTape() as tape:
            if not self.first:
                tape.watch(x)
            loss = self._forward_loss(x, target, weight)
        variables = _stage_variables(self.layers)
        gradients = _dense(tape.gradient(loss, variables + ([] if self.first else [x])))
        input_gradient = None if self.first else gradients.pop()
        if not self.first and input_gradient is None:
            input_gradient = tf.zeros_like(x)
        return loss, _summed(sums, gradients), input_gradient


class TFStageWork:
    """Forward and backward of one stage's layers on micro-batch i.

    On stages before the last, forward records micro-batch i under its own ``tf.GradientTape``
    (watching the received input) through ``functions.forward``, and keeps the tape until backward
    asks it for the gradients of the stage's variables and input, given the output's gradient from
    the next stage. On the last stage, a micro-batch whose backward directly follows its forward in
    the schedule (``fused``: all with 1F1B, the last one with GPipe) runs forward, loss and backward
    in one compiled call at forward time (``StageFunctions.last_step``), keeping only its input's
    gradient until the backward sends it; the others are taped (``forward_loss``), so that GPipe's
    backward messages still flow one by one while the first stages compute. The loss is weighted by
    the micro-batch's share of rows, so the summed gradients are those of the mini-batch's mean loss;
    the sums are added inside the compiled calls. Before the layers are built, every stage runs
    eagerly under a tape.

    With ``split`` (the schedule has W actions, ``"zb-h1"``), backward computes only the input's
    gradient and ``weight(i)`` the weights' later (``dualframe.tensorflow.pipeline.backward``): F keeps
    every layer's input, B keeps the gradient at each weighted layer's output, W adds the weights'
    gradient to the sums. Where the stage cannot split (not built yet: the first step; or a layer
    with state), B runs the full backward and W only adds its weights' part: correct, no gain.
    With ``batch_weights`` too (GPipe with ``schedule.deferred_weights``), the W actions wait until every
    micro-batch's has come and run as one ``batched_weight_pass``; the last stage's F keeps its
    layers' inputs and the loss's gradient at its output (``last_forward_inputs``) for its B, the
    fused last micro-batch runs F and B in one call (``last_input_pass``).

    With ``recompute`` (activation checkpointing), a micro-batch it names (but the last stage's fused ones,
    which keep nothing) runs its forward without a tape, keeping only its input, and again, as above, at
    the start of its backward.

    Example:
        >>> work = TFStageWork(layers, True, True, loss, [y0], [1.0], fused={0})   # doctest: +SKIP
        >>> work.forward(0, x0); work.backward(0, None); work.gradients            # doctest: +SKIP
    """

    def __init__(self, layers: Sequence[Any], first: bool, last: bool, loss_fn: Optional[Callable[[Any, Any], Any]], targets: List[tf.Tensor], weights: List[float],
                 device: Optional[str] = None, functions: Optional[StageFunctions] = None,
                 fused: Collection[int] = (), split: bool = False, batch_weights: bool = False,
                 recompute: Optional[StageRecompute] = None) -> None:
        self.layers, self.first, self.last = list(layers), first, last
        self.functions = functions if functions is not None and functions.ready() else None
        self.split = split
        self.split_passes = split and self.functions is not None and self.functions.splittable()
        if split and self.functions is not None and not self.split_passes and not _WARNED:
            _WARNED.append(True)
            _LOG.warning("a layer of this stage has state (non-trainable variables), so its backward cannot be "
                         "re-run in two passes: B runs the whole backward, W only adds it (no zero-bubble gain)")
        # i -> what W i needs: ("sums", the weights' gradients) or ("split", owners' inputs, output gradients)
        self._pending: Dict[int, Tuple[Any, ...]] = {}
        self.batch_weights = batch_weights and self.split_passes
        self._weights_due: List[int] = []  # W actions come, waiting for the batched pass
        self.fused = set(fused) if last else set()
        self.recompute = recompute
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

    def _loss(self, i: int, x: tf.Tensor) -> tf.Tensor:
        weight = tf.constant(self.weights[i], tf.float64)
        if self.functions is not None:
            return self.functions.forward_loss(x, self.targets[i], weight)
        assert self.loss_fn is not None
        loss = tf.reduce_mean(self.loss_fn(self.targets[i], self._run(x, training=True)))
        return loss * tf.cast(weight, loss.dtype)

    def _keep(self, i: int, saved: Any) -> None:
        self._saved[i] = saved
        self.peak_live = max(self.peak_live, len(set(self._saved) | set(self._pending)))

    def _sums(self) -> Optional[Gradients]:
        """The step's gradient sums so far, None before the first micro-batch's (then the variables are read)."""
        if not self.variables:
            self.variables = _stage_variables(self.layers)
        return self.gradients or None

    def _add(self, gradients: Sequence[Any]) -> None:
        """Add one micro-batch's variable gradients to the step's sums (None: not connected to the loss)."""
        sums, new = self._sums(), _dense(gradients)
        if sums is not None and self.functions is not None:
            self.gradients = self.functions.accumulate(sums, new)
        else:
            self.gradients = _summed(sums, new)

    def forward(self, i: int, x: tf.Tensor) -> Optional[tf.Tensor]:
        training = self.loss_fn is not None
        with tf.device(self.device):
            if not training:
                y = self._run(x, training=False)
                if self.last:
                    self.outputs.append(y)
                return None if self.last else y
            if i in self.fused and self.split_passes:
                self._last_input_pass(i, x)
                return None
            if i in self.fused and self.functions is not None and not self.split:  # W i adds a taped B
                self._last_step(i, x)
                return None
            if self.recompute is not None and i in self.recompute:
                self.recompute.forward(i)
                y = self._loss(i, x) if self.last else self._run(x, training=True)  # no tape: nothing kept
                self._keep(i, ("replay", x))
            else:
                saved, y = self._recorded(i, x)
                self._keep(i, saved)
        if self.last:
            self.loss_sum += float(y)
            return None
        return y

    def _recorded(self, i: int, x: tf.Tensor) -> Tuple[Tuple[Any, ...], tf.Tensor]:
        """Micro-batch i's forward keeping what its backward needs: (that, the output or the last stage's loss)."""
        if self.split_passes and not self.last:
            y, inputs = self.functions.forward_inputs(x)  # type: ignore[union-attr]
            return ("split", inputs, None), y
        if self.split_passes and self.batch_weights:
            loss, inputs, output_grad = self.functions.last_forward_inputs(  # type: ignore[union-attr]
                x, self.targets[i], tf.constant(self.weights[i], tf.float64))
            return ("split", inputs, output_grad), loss
        with tf.GradientTape() as tape:
            if not self.first:
                tape.watch(x)
            y = self._loss(i, x) if self.last else self._run(x, training=True)
        return (tape, x, y), y

    def _last_step(self, i: int, x: tf.Tensor) -> None:
        assert self.functions is not None
        loss, self.gradients, input_gradient = self.functions.last_step(
            x, self.targets[i], tf.constant(self.weights[i], tf.float64), self._sums())
        self._keep(i, input_gradient)
        self.loss_sum += float(loss)

    def _last_input_pass(self, i: int, x: tf.Tensor) -> None:
        assert self.functions is not None
        loss, input_gradient, inputs, kept = self.functions.last_input_pass(
            x, self.targets[i], tf.constant(self.weights[i], tf.float64))
        self._pending[i] = ("split", inputs, kept)
        self._keep(i, input_gradient)
        self.loss_sum += float(loss)

    def backward(self, i: int, grad: Optional[tf.Tensor]) -> Optional[tf.Tensor]:
        saved = self._saved.pop(i)
        if not isinstance(saved, tuple):  # the last stage's compiled step already ran: its input's gradient
            return saved
        if saved[0] == "replay":  # checkpointed: its forward again, now keeping what backward needs
            assert self.recompute is not None
            with tf.device(self.device), self.recompute.replaying(i):
                saved, _ = self._recorded(i, saved[1])
        if saved[0] == "split":  # B i of a split backward: the input's gradient, W's inputs kept
            assert self.functions is not None
            with tf.device(self.device):
                input_grad, kept = self.functions.input_pass(saved[1], grad if saved[2] is None else saved[2])
            self._pending[i] = ("split", self.functions.split.owner_inputs(saved[1]), kept)
            return input_grad
        tape, x, y = saved
        variables = _stage_variables(self.layers)
        with tf.device(self.device):
            grads = tape.gradient(y, variables + ([] if self.first else [x]),
                                  output_gradients=None if self.last else grad)
            if self.split:
                self._pending[i] = ("sums", grads[:len(variables)])
            else:
                self._add(grads[:len(variables)])
        if self.first:
            return None
        input_grad = grads[-1]
        return tf.zeros_like(x) if input_grad is None else tf.convert_to_tensor(input_grad)

    def weight(self, i: int) -> None:
        """W i: micro-batch i's weights' gradient added to the step's sums (after its backward)."""
        if self.batch_weights:
            self._weights_due.append(i)
            if len(self._weights_due) == len(self.weights):
                self._batched_weights()
            return
        pending = self._pending.pop(i)
        if pending[0] == "sums":
            self._add(pending[1])
            return
        assert self.functions is not None
        with tf.device(self.device):
            self.gradients = self.functions.weight_pass(pending[1], pending[2], self._sums())

    def _batched_weights(self) -> None:
        """Every micro-batch's W in one pass over their rows, added to the step's sums."""
        assert self.functions is not None
        parts = [self._pending.pop(i) for i in sorted(self._weights_due)]
        self._weights_due = []
        with tf.device(self.device):
            self.gradients = self.functions.batched_weight_pass(
                [part[1] for part in parts], [part[2] for part in parts], self._sums())

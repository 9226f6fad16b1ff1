"""A Keras process stage's compiled passes: one ``tf.function`` (XLA where it compiles) per pass, kept across steps."""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dualframe.pipeline.graph import GraphSplit
from dualframe.pipeline.graph_walk import edge_values, stage_edges
from dualframe.tensorflow.graph.capture import KerasGraph
from dualframe.tensorflow.pipeline.graph import GraphStage
from dualframe.tensorflow.pipeline.graph_backward import GraphSplitPasses

Gradients = List[Optional[tf.Tensor]]
_LOG = logging.getLogger(__name__)


def dense(gradients: Sequence[Any]) -> Gradients:
    """IndexedSlices (a gather's gradient) made dense: a received value's gradient is sent as a tensor."""
    return [None if g is None else tf.convert_to_tensor(g) for g in gradients]


def summed(sums: Optional[Sequence[Any]], gradients: Gradients) -> Gradients:
    """``sums + gradients`` term by term (None: a variable not connected to the loss); ``sums`` None: the first."""
    if sums is None:
        return list(gradients)
    return [a if b is None else b if a is None else a + b for a, b in zip(sums, gradients)]


class CompiledPass:
    """A ``tf.function`` compiled with XLA where XLA compiles it, else a plain one, decided at its first call.

    XLA's kernels keep their speed per row at micro-batch sizes where TensorFlow's own CPU matmul
    slows down (here 1.4x per row at 256 rows against 2048, docs/benchmarks.md), so micro-batching
    costs little. A stage whose ops XLA cannot compile (strings, some dynamic shapes) falls back to a
    plain ``tf.function`` once, with a log line; XLA compiles before running, so nothing ran twice.

    Example:
        >>> double = CompiledPass(lambda x: 2 * x, jit_compile=False)
        >>> int(double(tf.constant(3)))
        6
    """

    def __init__(self, python: Callable[..., Any], jit_compile: bool) -> None:
        self.python, self.jit_compile = python, jit_compile
        self.function = tf.function(python, jit_compile=jit_compile or None, reduce_retracing=True)
        self._proven = not jit_compile
        self._traced: Dict[Tuple[Any, ...], Any] = {}  # concrete functions by ``_call_traced``'s key

    def __call__(self, *args: Any) -> Any:
        if self._proven:
            return self._call_traced(args)
        try:
            result = self.function(*args)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.InternalError) as error:
            _LOG.info("XLA could not compile %s (%s); running it as a plain tf.function",
                      getattr(self.python, "__name__", "a stage function"), error.message.strip().splitlines()[0])
            self.jit_compile = False
            self.function = tf.function(self.python, reduce_retracing=True)
            self._traced = {}
            result = self.function(*args)
        self._proven = True
        return result

    def _call_traced(self, args: Tuple[Any, ...]) -> Any:
        """The function traced for these arguments, called on their tensors alone.

        ``tf.function`` works out every argument's type on each call to pick its trace (0.3-0.4 ms a call
        for a stage's passes here, a dozen calls per micro-batch step): this keys the trace on the
        arguments' dict keys, values and shapes instead, and hands the tensors to it directly. Arguments
        it cannot key (not a tensor, None or a plain value) take ``tf.function``'s own way.
        """
        leaves = tf.nest.flatten(args, expand_composites=True)
        key: List[Any] = [tuple(sorted(a)) if isinstance(a, dict) else None for a in args]
        tensors = []
        for leaf in leaves:
            if isinstance(leaf, tf.Tensor):
                key.append((leaf.dtype, tuple(leaf.shape)))
                tensors.append(leaf)
            elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                key.append(leaf)
            else:
                return self.function(*args)
        found = self._traced.get(tuple(key))
        if found is None:
            found = self._traced[tuple(key)] = self.function.get_concrete_function(*args)
        return found._call_flat(tensors, found.captured_inputs)  # the call tf.function itself makes

    def tracing_count(self) -> int:
        """How many times the function traced so far (the same after every step once the shapes were seen)."""
        return int(self.function.experimental_get_tracing_count())


class GraphStageFunction:
    """Stage j's passes (and on the last stage the weighted loss) as compiled calls, made once per pipeline.

    ``call(values, training, target, weight)`` runs the stage on ``values`` (what it reads, by value
    name) and returns (the values for each later stage, by stage; the weighted loss on the last stage
    when training, else None; the model's outputs on the last stage when not training, else None).
    A tape records the call as one op, and its backward is one compiled call too.
    ``last_step(values, target, weight, sums)`` is the last stage's whole micro-batch in one call:
    forward, weighted loss, the gradients of the stage's variables added to ``sums`` (None: the first; an
    Embedding's IndexedSlices returned as is, ``sums`` holding None there)
    and those of the received values, by name; the last stage needs no gradient from a neighbour, so a
    micro-batch whose backward directly follows its forward (``fusable``) runs it at forward time.
    ``forward_kept``, ``input_pass``, ``last_input_pass`` and ``weight_pass`` are the split backward's F,
    B, F+B of the last stage and W (``dualframe.tensorflow.pipeline.graph_backward``), compiled alike;
    ``batched_weight_pass`` the W of every micro-batch of a GPipe step in one pass over their rows,
    compiled without XLA (at the mini-batch's rows TensorFlow's own CPU matmul is the faster one).
    Each is traced once per input shape and mode.

    Example:
        >>> function = GraphStageFunction(stage, split, 1, captured, keras.losses.get("mse"))        # doctest: +SKIP
        >>> sent, loss, _ = function.call({"h": h}, True, y, tf.constant(0.5, tf.float64))           # doctest: +SKIP
    """

    def __init__(self, stage: GraphStage, split: GraphSplit, j: int, captured: KerasGraph,
                 loss_fn: Optional[Callable[[Any, Any], Any]], jit_compile: bool = True) -> None:
        self.stage, self.split, self.captured, self.loss_fn = stage, split, captured, loss_fn
        self.last = j == split.stages - 1
        self.outgoing = {c: edge_values(split, j, c) for c in stage_edges(split, j).targets}
        self.call = CompiledPass(self._call, jit_compile)
        self.last_step = CompiledPass(self._last_step, jit_compile)
        self.accumulate = CompiledPass(summed, jit_compile)
        self.passes = GraphSplitPasses(stage, split, j, captured, loss_fn)
        self.forward_kept = CompiledPass(self.passes.forward_kept, jit_compile)
        self.input_pass = CompiledPass(self.passes.input_pass, jit_compile)
        self.last_input_pass = CompiledPass(self.passes.last_input_pass, jit_compile)
        self.weight_pass = CompiledPass(self.passes.weight_pass, jit_compile)
        self.batched_weight_pass = CompiledPass(self.passes.batched_weight_pass, False)

    def tracing_counts(self) -> Dict[str, int]:
        """Traces per pass so far (a test checks that no step after the first traces again)."""
        return {name: getattr(self, name).tracing_count()
                for name in ("call", "last_step", "accumulate", "forward_kept", "input_pass", "last_input_pass",
                             "weight_pass", "batched_weight_pass")}

    def _call(self, values: Dict[str, Any], training: bool, target: Any,
              weight: Any) -> Tuple[Dict[int, List[Any]], Any, Optional[List[Any]]]:
        values = dict(values)
        self.stage.run(values, training)
        sent = {c: [values[v] for v in names] for c, names in self.outgoing.items()}
        if not self.last:
            return sent, None, None
        flat = [values[v] for v in self.split.graph.outputs]
        if not training:
            return sent, None, flat
        assert self.loss_fn is not None
        loss = tf.reduce_mean(self.loss_fn(target, self.captured.pack_outputs(flat)))
        return sent, loss * tf.cast(weight, loss.dtype), None

    def _last_step(self, values: Dict[str, Any], target: Any, weight: Any,
                   sums: Optional[Gradients]) -> Tuple[Any, Gradients, Dict[str, Any]]:
        passes = self.passes
        sources = [v for v in passes.received if values[v].dtype.is_floating and passes.wanted(v)]
        variables = list(self.stage.trainable_weights)
        with tf.GradientTape() as tape:
            tape.watch([values[v] for v in sources])
            _, loss, _ = self._call(values, True, target, weight)
        found = tape.gradient(loss, variables + [values[v] for v in sources])  # an Embedding's: IndexedSlices
        grads = dict(zip(sources, dense(found[len(variables):])))
        return loss, summed(sums, found[:len(variables)]), {v: grads.get(v) for v in passes.received}

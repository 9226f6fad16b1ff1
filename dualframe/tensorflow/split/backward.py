"""A one-process Keras split's cell backward, recomputed or timed: variable gradients as the tape gives them."""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.eager import record as tape_record  # what tf.recompute_grad stops outer tapes with

from dualframe.pipeline.executor import RecordFn
from dualframe.tensorflow.pipeline.recompute import swapped

Cell = Callable[..., Tuple[tf.Tensor, ...]]


def recomputed(fn: Cell, state: Sequence[Any]) -> Cell:
    """``fn`` keeping only its inputs: its backward runs it again under a tape, from the forward's ``state``.

    Like ``tf.recompute_grad`` over floating-point values only (integer and boolean inputs and outputs, token
    ids and masks, carry no gradient; the non-float outputs are the forward's), with one difference: each
    variable's gradient is what the replay's tape gives, so an Embedding's stays ``tf.IndexedSlices``
    (``tf.recompute_grad`` returns its gradients through a nested custom gradient that makes them dense, and
    Keras's optimizers then update, and Adam decays, every row instead of the rows read). The replay starts
    from the ``state`` variables' values of the forward (Dropout draws the forward's mask again,
    BatchNormalization's moving statistics move once) and puts back what they held before it.

    Example:
        >>> cell = recomputed(stage_fn, dropout_seeds)          # doctest: +SKIP
        >>> outputs = cell(hidden, mask)                        # doctest: +SKIP
    """

    def run(*xs: tf.Tensor) -> Tuple[tf.Tensor, ...]:
        where = [k for k, x in enumerate(xs) if x.dtype.is_floating]
        before = [tf.identity(v) for v in state]
        others: List[List[Any]] = []

        def call(floats: Sequence[tf.Tensor]) -> Tuple[tf.Tensor, ...]:
            args = list(xs)
            for k, x in zip(where, floats):
                args[k] = x
            return fn(*args)

        @tf.custom_gradient
        def floats_only(*floats: tf.Tensor) -> Any:
            with tape_record.stop_recording():  # no tape keeps the forward's activations
                ys = call(floats)
            others.append([None if y.dtype.is_floating else y for y in ys])

            def grad(*dys: Any, variables: Optional[List[tf.Variable]] = None) -> Any:
                watched, started = list(variables or []), _backward_started(dys)
                # A data dependency, not tf.control_dependencies: XLA drops control edges, and under one the
                # replay's variable reads lose their order before the optimizer's writes in a compiled fit.
                again = [x + tf.cast(started[0], x.dtype) if started else tf.identity(x) for x in floats]
                with swapped(state, before), tf.GradientTape() as tape:
                    tape.watch(again + watched)
                    ys = [y for y in call(again) if y.dtype.is_floating]
                grads = tape.gradient(ys, again + watched, output_gradients=list(dys))
                return grads[:len(again)], grads[len(again):]

            return tuple(y for y in ys if y.dtype.is_floating), grad

        floats = iter(floats_only(*[xs[k] for k in where]))
        return tuple(next(floats) if y is None else y for y in others[0])

    return run


def _backward_started(dys: Sequence[Any]) -> List[tf.Tensor]:
    """In a graph, a zero ready only once the output gradients are (NaN if the first is), else nothing.

    Added to the replay's inputs: without it the executor may replay as soon as the inputs exist, during the
    forward, and keep the activations after all (``tf.recompute_grad`` makes the same dependency).
    """
    given = [dy.values if isinstance(dy, tf.IndexedSlices) else dy for dy in dys if dy is not None]
    if tf.executing_eagerly() or not given:
        return []
    first = tf.reduce_max(tf.reshape(given[0], [-1])[:1])
    return [tf.where(tf.math.is_nan(tf.cast(first, tf.float32)), float("nan"), 0.0)]


def timed_backward(fn: Cell, i: int, j: int, record: RecordFn) -> Cell:
    """``fn`` whose gradient, when eager, is timed as the backward cell (i, j) of the timeline.

    Example:
        >>> cell = timed_backward(stage_fn, 0, 1, pipe.recorder(pipe.devices))   # doctest: +SKIP
    """

    @tf.custom_gradient
    def timed(*xs: tf.Tensor) -> Any:
        floats = [x for x in xs if x.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats)
            ys = fn(*xs)

        def grad(*dys: tf.Tensor, variables: Optional[List[tf.Variable]] = None) -> Any:
            start = time.perf_counter()
            pairs = [(y, dy) for y, dy in zip(ys, dys) if y.dtype.is_floating]
            grads = tape.gradient([y for y, _ in pairs], floats + list(variables or []),
                                  output_gradients=[dy for _, dy in pairs])
            record("B", i, j, start, time.perf_counter())
            by_input = iter(grads[:len(floats)])
            return [next(by_input) if x.dtype.is_floating else None for x in xs], grads[len(floats):]

        return ys, grad

    return timed

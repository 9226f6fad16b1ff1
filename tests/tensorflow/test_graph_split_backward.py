"""ZB-H1 on a functional Keras model's process stages, in one process: B then W equal one tape over the model.

The stages' works (``TFGraphStageWork``) run in clock order (``clock_table(rank_schedule(...))``) along
the graph's edges, messages passed by hand: skip edges over a stage, a bool mask beside a float, two
model outputs, attention, and a BatchNorm stage (not splittable: B runs the whole backward, W adds it).
Eager works and compiled ones (``GraphStageFunction``, XLA) both.
"""
import numpy as np
import pytest
import keras
import tensorflow as tf

from dualframe.pipeline.clock import clock_table
from dualframe.pipeline.microbatch import micro_batch_sizes
from dualframe.pipeline.action import fusable
from dualframe.pipeline.schedule import batched_weights, rank_schedule
from dualframe.tensorflow.pipeline.graph import process_stages
from dualframe.tensorflow.graph.capture import capture
from dualframe.tensorflow.pipeline.graph_work import GraphStageFunction, TFGraphStageWork

from test_graph_split import encoder, encoder_batch, gated, loss_of, resnet, rows_of, run


def side_output(seed=2):
    """Stage 0 makes a model output the last stage reads only in the loss (its gradient must still come back)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(6, activation="tanh", name="d1")(x)
    aux = keras.layers.Lambda(lambda t: keras.ops.sum(t, axis=-1, keepdims=True), name="aux")(h)
    out = keras.layers.Dense(3, name="head")(keras.layers.Dense(6, name="d2")(h))
    return keras.Model(x, [aux, out])


def clock_walk(model, balance, inputs, chunks, schedule, compiled, fused=False, batch_weights=False):
    """The stages of ``model`` stepped in ``schedule``'s clock order: loss, gradients in model order, the works.

    ``fused``: the last stage runs F and B of each micro-batch its list runs back to back in one call;
    ``batch_weights``: GPipe's lists with a W per B after the last B (``batched_weights``), run as one pass.
    """
    captured = capture(model)
    split, stages = process_stages(captured, balance=balance)
    rows = tf.nest.flatten(inputs)[0].shape[0]
    sizes = micro_batch_sizes(rows, chunks)
    micro = rows_of(dict(zip(split.graph.inputs, captured.flat_inputs(inputs))), sizes)
    loss = lambda _, out: loss_of(out)  # noqa: E731
    lists = rank_schedule(schedule, len(stages), chunks)
    lists = batched_weights(lists) if batch_weights else lists
    works = [TFGraphStageWork(stage, split, j, captured, loss, [None] * chunks, [s / rows for s in sizes],
                              function=GraphStageFunction(stage, split, j, captured, loss) if compiled else None,
                              split_backward=any(a.kind == "W" for a in lists[j]),
                              fused=fusable(lists[j]) if fused else (), batch_weights=batch_weights)
             for j, stage in enumerate(stages)]
    forward, backward = {}, {}
    for row in clock_table(lists):
        for j, action in enumerate(row):
            if action is None:
                continue
            work, i = works[j], action.micro
            if action.kind == "F":
                received = {p: forward[(p, j, i)] for p in work.incoming}
                if j == 0:
                    received[-1] = micro[i]
                forward.update({(j, c, i): m for c, m in work.forward(i, received).items()})
            elif action.kind == "B":
                grads = {c: backward[(j, c, i)] for c in work.outgoing}
                backward.update({(p, j, i): m for p, m in work.backward(i, grads).items()})
            else:
                work.weight(i)
    assert not any(work._pending or work._saved for work in works)
    # an Embedding's IndexedSlices compared dense
    by_path = {v.path: g for stage, work in zip(stages, works)
               for v, g in zip(stage.trainable_weights, work.step_gradients())}
    return works[-1].loss_sum, [None if by_path.get(v.path) is None else tf.convert_to_tensor(by_path[v.path])
                                for v in model.trainable_variables], works


def reference(model, x, chunks):
    """The unsplit model fed the same micro-batches: loss and gradients, each weighted by its share of rows."""
    rows = tf.nest.flatten(x)[0].shape[0]
    want_loss, want_grads = 0.0, [0.0] * len(model.trainable_variables)
    for part, size in zip(rows_of(x, micro_batch_sizes(rows, chunks)), micro_batch_sizes(rows, chunks)):
        _, loss, grads = run(model, part)
        grads = grads[len([v for v in tf.nest.flatten(part) if v.dtype.is_floating]):]
        want_loss += float(loss) * size / rows
        want_grads = [a + tf.convert_to_tensor(b) * size / rows for a, b in zip(want_grads, grads)]
    return want_loss, want_grads


@pytest.mark.parametrize("make, balance, x", [
    (lambda: resnet(bn=False), [3, 1, 11], tf.random.normal((9, 8, 8, 3), seed=6)),  # skips over stage 1
    (gated, [3, 3], tf.random.normal((9, 4), seed=7)),                               # a bool beside a float
    (lambda: encoder(blocks=2), [10, 10], None),           # attention, a bool mask crossing, two outputs
    (side_output, [4, 1], tf.random.normal((9, 4), seed=8)),  # an output made on stage 0, read by the loss only
])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "xla"])
def test_zb_h1_b_then_w_equals_one_tape_over_the_model(make, balance, x, compiled):
    model = make()
    x = encoder_batch(9) if x is None else x
    want_loss, want_grads = reference(model, x, 4)
    for _ in range(2):  # twice: the compiled passes' traces are reused
        loss, grads, works = clock_walk(model, balance, x, 4, "zb-h1", compiled)
        assert all(work.split_passes for work in works)
        np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=0)
        for variable, got, want in zip(model.trainable_variables, grads, want_grads):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0, err_msg=variable.path)
    # ZB-H1's peak counted until W (n), plus the micro-batch being kept while a W waits (as for layer lists).
    assert max(work.peak_live for work in works) <= len(works) + 1, [w.peak_live for w in works]
    if compiled:
        assert works[0].function.forward_kept.jit_compile and works[0].function.weight_pass.jit_compile


@pytest.mark.parametrize("make, balance, x", [
    (lambda: resnet(bn=False), [3, 1, 11], tf.random.normal((9, 8, 8, 3), seed=6)),  # skips over stage 1
    (lambda: encoder(blocks=2), [10, 10], None),           # attention, a bool mask crossing, two outputs
    (side_output, [4, 1], tf.random.normal((9, 4), seed=8)),  # an output made on stage 0, read by the loss only
])
@pytest.mark.parametrize("schedule, batch", [("gpipe", True), ("gpipe", False), ("1f1b", False)],
                         ids=["gpipe-batched-w", "gpipe", "1f1b"])
def test_fused_last_stage_and_gpipe_batched_weights_equal_one_tape(make, balance, x, schedule, batch):
    """The last stage's F+loss+B in one call (its fusable micro-batches) and GPipe's W passes as one over the rows."""
    model = make()
    x = encoder_batch(9) if x is None else x
    want_loss, want_grads = reference(model, x, 4)
    counts = None
    for _ in range(2):  # twice: the compiled passes' traces are reused
        loss, grads, works = clock_walk(model, balance, x, 4, schedule, True, fused=True, batch_weights=batch)
        np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=0)
        for variable, got, want in zip(model.trainable_variables, grads, want_grads):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0, err_msg=variable.path)
        assert counts is None or [w.function.tracing_counts() for w in works] == counts
        counts = [w.function.tracing_counts() for w in works]
    assert (counts[-1]["last_step"] > 0) == (not batch), counts[-1]  # split passes replace the fused step
    assert all((c["batched_weight_pass"] == 1) == batch for c in counts), counts
    assert [w.batch_weights for w in works] == [batch] * len(works)


def test_a_stage_with_batch_norm_runs_the_full_backward_in_b_and_keeps_the_statistics():
    """BatchNorm's moving statistics update once per micro-batch, exactly as the unsplit model fed the micro-batches."""
    x = tf.random.normal((8, 8, 8, 3), seed=8)
    model, split_model = resnet(seed=3), resnet(seed=3)
    want_loss, want_grads = reference(model, x, 4)
    loss, grads, works = clock_walk(split_model, [3, 6, 8], x, 4, "zb-h1", compiled=True)
    assert [work.split_passes for work in works] == [True, False, False]  # the BatchNorms live in stages 1 and 2
    np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=0)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    for got, want in zip(split_model.non_trainable_variables, model.non_trainable_variables):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0, err_msg=want.path)

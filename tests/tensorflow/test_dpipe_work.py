"""One Keras pipeline stage's work on a chain of layers (dualframe.tensorflow.pipeline.graph_work), in one process:
the last stage's compiled forward+loss+backward against one tape over the whole batch and against the taped path,
ZB-H1's split passes and GPipe's batched W, each stage a graph stage of a chain (edges j - 1 -> j)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from dualframe.pipeline.action import fusable
from dualframe.pipeline.graph_walk import edge_values
from dualframe.pipeline.schedule import deferred_weights, rank_schedule
from dualframe.tensorflow.graph.capture import capture
from dualframe.tensorflow.pipeline.compiled import GraphStageFunction
from dualframe.tensorflow.pipeline.graph import process_stages
from dualframe.tensorflow.pipeline.graph_work import TFGraphStageWork
from dualframe.tensorflow.pipeline.message import pack, unpack

SIZES = [3, 3, 2, 2]  # 10 rows in 4 micro-batches


class ChainStage:
    """``layers`` as stage j of a chain cut as a graph: a pass-through stage before it unless first, after it unless last.

    ``function`` (the compiled passes) is made at the first ``work`` after the layers are built, and kept.
    """

    def __init__(self, layers, first, last, loss=None):
        self.layers, self.first, self.last = list(layers), first, last
        self.loss = loss or keras.losses.MeanSquaredError()
        before, after = [] if first else [keras.layers.Identity()], [] if last else [keras.layers.Identity()]
        self.captured = capture(before + self.layers + after)
        balance = [1] * len(before) + [len(self.layers)] + [1] * len(after)
        self.split, stages = process_stages(self.captured, balance=balance)
        self.j, self.function = len(before), None
        self.stage = stages[self.j]

    def compiled(self):
        if self.function is None and all(layer.built for layer in self.layers):
            self.function = GraphStageFunction(self.stage, self.split, self.j, self.captured, self.loss)
        return self.function

    def work(self, targets, weights, fused=(), split_backward=False, batch_weights=False):
        return TFGraphStageWork(self.stage, self.split, self.j, self.captured, self.loss, targets if self.last else [],
                                weights, "/CPU:0", self.compiled(), split_backward=split_backward, fused=fused,
                                batch_weights=batch_weights)

    def forward(self, work, i, x):
        """F i from the previous stage's output ``x`` (the inputs on the first): the output sent on, None on the last."""
        j = self.j
        received = {-1: {self.split.graph.inputs[0]: x}} if self.first else {j - 1: pack([x], edge_values(self.split, j - 1, j))}
        sent = work.forward(i, received)
        return None if self.last else unpack(sent[j + 1])[0]

    def backward(self, work, i, grad):
        """B i from the output's gradient (None on the last): the input's gradient, None on the first."""
        j = self.j
        grads = {} if self.last else {j + 1: pack([grad], edge_values(self.split, j, j + 1))}
        back = work.backward(i, grads)
        return None if self.first else unpack(back[j - 1])[0]


def run_step(stage, x, y, schedule):
    """One training step of a last stage over SIZES micro-batches, in the order of ``schedule``'s last stage;
    micro-batches whose backward follows their forward are fused. Returns the work and the input gradients."""
    plan = rank_schedule("gpipe" if schedule == "taped" else schedule, 2, len(SIZES))[1]
    xs, ys = tf.split(x, SIZES), tf.split(y, SIZES)
    work = stage.work(ys, [s / sum(SIZES) for s in SIZES], fusable(plan) if schedule != "taped" else ())
    input_grads = [None] * len(SIZES)
    for action in plan:
        if action.kind == "F":
            assert stage.forward(work, action.micro, xs[action.micro]) is None
        else:
            input_grads[action.micro] = stage.backward(work, action.micro, None)
    return work, input_grads


def whole_batch(layers, x, y, first):
    """The reference: one tape over the whole batch's mean loss."""
    with tf.GradientTape() as tape:
        if not first:
            tape.watch(x)
        out = x
        for layer in layers:
            out = layer(out, training=True)
        loss = keras.losses.MeanSquaredError()(y, out)
    variables = [v for layer in layers for v in layer.trainable_weights]
    grads = tape.gradient(loss, variables + ([] if first else [x]))
    return float(loss), [tf.convert_to_tensor(g) for g in grads]


def dense_stage(seed=1):
    init = keras.initializers.GlorotUniform
    return [keras.layers.Dense(8, "tanh", kernel_initializer=init(seed)), keras.layers.Dense(3, kernel_initializer=init(seed + 1))]


def test_fusable_micro_batches_of_the_schedules():
    assert fusable(rank_schedule("gpipe", 2, 4)[1]) == [3]
    assert fusable(rank_schedule("1f1b", 2, 4)[1]) == [0, 1, 2, 3]
    assert fusable(rank_schedule("1f1b", 2, 4)[0]) == []  # F0 F1 B0 F2 B1 F3 B2 B3


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "taped"])
def test_last_stage_equals_one_tape_over_the_batch(schedule):
    rng = np.random.RandomState(0)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))
    layers = dense_stage()
    stage = ChainStage(layers, first=False, last=True)
    eager, _ = run_step(stage, x, y, schedule)  # unbuilt: the eager path builds them
    assert eager.function is None and stage.compiled() is not None
    work, input_grads = run_step(stage, x, y, schedule)
    # 1F1B's last stage holds one micro-batch (its input gradients) at a time, GPipe's all four.
    assert work.function is stage.function and work.peak_live == (1 if schedule == "1f1b" else 4)
    loss, expected = whole_batch(layers, x, y, first=False)
    assert work.loss_sum == pytest.approx(loss, abs=1e-6)
    for got, want in zip(work.gradients + [tf.concat(input_grads, 0)], expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)
    for got, want in zip(eager.gradients, work.gradients):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)


def test_embedding_gradients_stay_sparse_in_the_compiled_step():
    ids = tf.constant(np.random.RandomState(1).randint(0, 20, size=(10, 2)))
    y = tf.constant(np.random.RandomState(2).randn(10, 3).astype("float32"))
    layers = [keras.layers.Embedding(20, 4, embeddings_initializer=keras.initializers.RandomNormal(seed=3)),
              keras.layers.Flatten()] + dense_stage(4)
    model = keras.Sequential([keras.Input((2,), dtype="int64")] + layers)
    assert model.built
    work, input_grads = run_step(ChainStage(layers, first=True, last=True), ids, y, "1f1b")
    assert input_grads == [None] * 4
    _, expected = whole_batch(layers, ids, y, first=True)
    gradients = work.step_gradients()
    assert work.gradients[0] is None and isinstance(gradients[0], tf.IndexedSlices)  # kept out of the dense sums
    assert gradients[0].indices.shape[0] == 10 * 2  # every micro-batch's rows, as the whole batch's gradient
    for got, want in zip(gradients, expected):
        np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), want.numpy(), atol=1e-6, rtol=0)


def test_batch_norm_and_dropout_fused_as_taped():
    """BatchNorm's moving statistics move once per micro-batch either way; dropout's mask is the one its own backward uses."""
    rng = np.random.RandomState(4)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))

    def stage():
        keras.utils.set_random_seed(5)
        layers = [keras.layers.Dense(6), keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(3)]
        keras.Sequential([keras.Input((5,))] + layers)
        return layers

    results = []
    for schedule in ("1f1b", "taped"):
        layers = stage()
        work, input_grads = run_step(ChainStage(layers, False, True), x, y, schedule)
        results.append((work.gradients + input_grads, layers[1].moving_mean.numpy()))
    (fused_grads, fused_mean), (taped_grads, taped_mean) = results
    assert not np.allclose(fused_mean, 0.0)
    np.testing.assert_allclose(fused_mean, taped_mean, atol=1e-6, rtol=0)
    for got, want in zip(fused_grads, taped_grads):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)
    # Dropout: with the mask drawn once in the compiled step, the input gradient is zero exactly where it dropped.
    keras.utils.set_random_seed(6)
    drop = [keras.layers.Dropout(0.5), keras.layers.Dense(3, use_bias=False, kernel_initializer="ones")]
    keras.Sequential([keras.Input((5,))] + drop)
    work, input_grads = run_step(ChainStage(drop, False, True), x, y, "1f1b")
    grads = tf.concat(input_grads, 0).numpy()
    assert 0 < (grads == 0).sum() < grads.size
    # The forward used the same mask: the loss and kernel gradient of x masked where the backward saw zeros.
    kept = tf.constant(x.numpy() * (grads != 0) * 2.0)
    kernel = tf.Variable(tf.ones((5, 3)))
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, kept @ kernel)
    assert work.loss_sum == pytest.approx(float(loss), abs=1e-5)
    np.testing.assert_allclose(work.gradients[0].numpy(), tape.gradient(loss, kernel).numpy(), atol=1e-5, rtol=0)


def stage_step(stage, x, y, schedule):
    """One step of stage 0 (first) or 1 (last) of 2 over SIZES micro-batches, gradients from the next stage all ones."""
    plan = rank_schedule(schedule, 2, len(SIZES))[1 if stage.last else 0]
    xs, ys = tf.split(x, SIZES), tf.split(y, SIZES)
    work = stage.work(ys, [s / sum(SIZES) for s in SIZES], fusable(plan))
    outputs = {}
    for action in plan:
        if action.kind == "F":
            outputs[action.micro] = stage.forward(work, action.micro, xs[action.micro])
        else:
            stage.backward(work, action.micro, None if stage.last else tf.ones_like(outputs[action.micro]))
    return work


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("last", [False, True])
def test_no_retracing_after_the_first_step(schedule, last):
    """Every micro-batch and pass is one compiled call whose traces (XLA compilations) are made in the first steps only."""
    rng = np.random.RandomState(7)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))
    layers = dense_stage(8)
    keras.Sequential([keras.Input((5,))] + layers)
    stage = ChainStage(layers, first=not last, last=last)
    first_step = stage_step(stage, x, y, schedule)
    functions = stage.function
    counts = functions.tracing_counts()
    assert sum(counts.values()) > 0 and functions.call.jit_compile
    for _ in range(3):
        work = stage_step(stage, x, y, schedule)
        assert functions.tracing_counts() == counts
    for got, want in zip(work.gradients, first_step.gradients):  # same weights, same batch: same sums
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)


class HostCall(keras.layers.Layer):
    """A layer XLA cannot compile (a call into Python), gradient passed straight through."""

    def call(self, x):
        @tf.custom_gradient
        def through(v):
            out = tf.numpy_function(lambda a: a * 2.0, [v], tf.float32, stateful=False)
            return tf.ensure_shape(out, v.shape), lambda g: 2.0 * g
        return through(x)


def test_stage_xla_cannot_compile_runs_as_plain_tf_function():
    rng = np.random.RandomState(9)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))
    layers = [HostCall()] + dense_stage(10)
    keras.Sequential([keras.Input((5,))] + layers)
    stage = ChainStage(layers, first=False, last=True)
    work, input_grads = run_step(stage, x, y, "1f1b")
    assert not stage.function.last_step.jit_compile
    doubled = [keras.layers.Lambda(lambda v: v * 2.0)] + layers[1:]
    loss, expected = whole_batch(doubled, x, y, first=False)
    assert work.loss_sum == pytest.approx(loss, abs=1e-6)
    for got, want in zip(work.gradients + [tf.concat(input_grads, 0)], expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)


def any_step(stage, x, y, schedule, grad_seed=3, plan=None, batch_weights=False):
    """One step of ``stage`` (as stage 0 or 1 of 2) in ``schedule``'s order (or ``plan``), W actions included; the
    next stage's gradients fixed random. Returns the work and the input gradients per micro-batch."""
    plan = plan or rank_schedule(schedule, 2, len(SIZES))[1 if stage.last else 0]
    xs, ys = tf.split(x, SIZES), tf.split(y, SIZES)
    work = stage.work(ys, [s / sum(SIZES) for s in SIZES], fusable(plan), split_backward=any(a.kind == "W" for a in plan),
                      batch_weights=batch_weights)
    outputs, input_grads = {}, {}
    for action in plan:
        i = action.micro
        if action.kind == "F":
            outputs[i] = stage.forward(work, i, xs[i])
        elif action.kind == "B":
            upstream = None if stage.last else tf.random.stateless_normal(tf.shape(outputs[i]), (grad_seed, i))
            input_grads[i] = stage.backward(work, i, upstream)
        else:
            work.weight(i)
    return work, [input_grads[i] for i in range(len(SIZES))]


def split_stage(seed=4):
    init = keras.initializers.GlorotUniform
    # Dense(activation=) re-runs its product in B; Dense then ReLU does not (see split_backward).
    return [keras.layers.Dense(8, "tanh", kernel_initializer=init(seed)), keras.layers.Dense(6, kernel_initializer=init(seed + 1)),
            keras.layers.ReLU(), keras.layers.Dense(3, kernel_initializer=init(seed + 2))]


@pytest.mark.parametrize("first,last", [(True, False), (False, True), (False, False)])
def test_zb_h1_b_then_w_equals_the_full_backward(first, last):
    """The split passes (B: input's gradient, W later: weights') give 1F1B's full backward: loss, input and weight gradients."""
    rng = np.random.RandomState(11)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))
    layers = split_stage()
    keras.Sequential([keras.Input((5,))] + layers)
    stage = ChainStage(layers, first=first, last=last)
    full, full_inputs = any_step(stage, x, y, "1f1b")
    for _ in range(2):  # the second step runs the compiled split passes (the first builds nothing here: built)
        split, split_inputs = any_step(stage, x, y, "zb-h1")
        assert split.split_passes and split.function is stage.function and not split._pending
        assert split.loss_sum == pytest.approx(full.loss_sum, abs=1e-6)
        for got, want in zip(split.gradients, full.gradients):
            np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)
        for got, want in zip(split_inputs, full_inputs):
            if first:
                assert got is None and want is None
            else:
                np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)
    assert split.peak_live <= 2 + (0 if last else 1)  # 1F1B's in-flight micro-batches, plus a W not yet run


def test_zb_h1_equals_one_tape_over_the_batch():
    """The last stage's split passes against the whole batch's one tape (not only against 1F1B)."""
    rng = np.random.RandomState(12)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))
    layers = split_stage(9)
    keras.Sequential([keras.Input((5,))] + layers)
    stage = ChainStage(layers, first=False, last=True)
    loss, want = whole_batch(layers, x, y, first=False)
    for _ in range(2):  # compiled split passes, twice
        work, input_grads = any_step(stage, x, y, "zb-h1")
        assert work.loss_sum == pytest.approx(loss, abs=1e-5)
        for got, expected in zip(work.gradients + [tf.concat(input_grads, 0)], want):
            np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("last", [False, True])
def test_zb_h1_stage_with_state_runs_the_full_backward_in_b(last):
    """BatchNormalization cannot be re-run (its moving statistics): B runs the whole backward, W adds it; equal to 1F1B.

    The last stage too, whose F and B would otherwise run as one compiled step that leaves W nothing to add."""
    rng = np.random.RandomState(13)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))
    results = []
    for schedule in ("1f1b", "zb-h1"):
        keras.utils.set_random_seed(5)
        layers = [keras.layers.Dense(6), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
        keras.Sequential([keras.Input((5,))] + layers)
        work, input_grads = any_step(ChainStage(layers, False, last), x, y, schedule)
        assert not work.split_passes
        results.append((work.gradients, input_grads, layers[1].moving_mean.numpy()))
    (g1, i1, m1), (g2, i2, m2) = results
    np.testing.assert_allclose(m1, m2, atol=1e-6, rtol=0)
    for got, want in zip(g2 + i2, g1 + i1):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)


def gpipe_batched_step(stage, x, y, grad_seed=3):
    """One GPipe step of stage 0 or 1 of 2 with the W passes batched after the last B (``deferred_weights``)."""
    plan = deferred_weights(rank_schedule("gpipe", 2, len(SIZES))[1 if stage.last else 0])
    return any_step(stage, x, y, "gpipe", grad_seed, plan=plan, batch_weights=True)


def test_deferred_weights_appends_a_w_per_b():
    plan = rank_schedule("gpipe", 2, 3)[0]
    assert [str(a) for a in deferred_weights(plan)] == "F0 F1 F2 B2 B1 B0 W2 W1 W0".split()


@pytest.mark.parametrize("first,last", [(True, False), (False, True), (False, False)])
def test_gpipe_batched_weights_equal_the_full_backward(first, last):
    """GPipe's W passes run as one over the step's rows: the same loss, weight and input gradients as GPipe's full backward."""
    rng = np.random.RandomState(14)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))
    layers = split_stage(15)
    keras.Sequential([keras.Input((5,))] + layers)
    stage = ChainStage(layers, first=first, last=last)
    full, full_inputs = any_step(stage, x, y, "gpipe")
    functions = stage.function
    for step in range(3):
        batched, batched_inputs = gpipe_batched_step(stage, x, y)
        assert batched.batch_weights and not batched._pending and not batched._weights_due
        assert batched.peak_live == len(SIZES)
        assert batched.loss_sum == pytest.approx(full.loss_sum, abs=1e-6)
        for got, want in zip(batched.gradients, full.gradients):
            np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)
        for got, want in zip(batched_inputs, full_inputs):
            if first:
                assert got is None and want is None
            else:
                np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)
        if step == 0:
            counts = functions.tracing_counts()
        assert functions.tracing_counts() == counts and counts["batched_weight_pass"] == 1
    if last:
        loss, want = whole_batch(layers, x, y, first=False)
        for got, expected in zip(batched.gradients + [tf.concat(batched_inputs, 0)], want):
            np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5, rtol=0)


def test_gpipe_batched_weights_keep_the_taped_path_for_a_stage_with_state():
    keras.utils.set_random_seed(5)
    layers = [keras.layers.Dense(6), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
    keras.Sequential([keras.Input((5,))] + layers)
    stage = ChainStage(layers, first=False, last=False)
    work = stage.work([], [0.5, 0.5], split_backward=True, batch_weights=True)
    assert not stage.function.passes.splittable() and not work.batch_weights


class _Block(keras.layers.Layer):
    """Weights through sublayers only, as a transformer block holds them."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = keras.layers.Dense(6, activation="relu"), keras.layers.Dense(5)

    def call(self, x):
        return x + self.outer(self.inner(x))


def test_gpipe_batches_weights_only_where_layers_rerun_cheaply():
    # A block re-runs its whole forward in B and again in W: GPipe keeps the taped path for it.
    dense = [keras.layers.Dense(5), keras.layers.ReLU(), keras.layers.Dense(5)]
    blocks = [keras.layers.Dense(5), _Block()]
    for layers in (dense, blocks):
        keras.Sequential([keras.Input((5,))] + layers)
    dense_passes = ChainStage(dense, first=False, last=False).compiled().passes
    block_passes = ChainStage(blocks, first=False, last=False).compiled().passes
    assert dense_passes.splittable() and dense_passes.reruns_cheaply() and dense_passes.batchable()
    assert block_passes.splittable() and not block_passes.reruns_cheaply()

"""dualframe.tensorflow.Pipeline: GPipe results equal the unsplit model's for balances, chunks, checkpoint modes."""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.errors import ScheduleError, StageError
from dualframe.pipeline.schedule import gpipe, one_process_ticks, register, unregister

from test_split import assert_same, grads, layers, reference_of


@pytest.mark.parametrize("balance, chunks, batch, checkpoint", [
    ([2, 2], 4, 10, "except_last"), ([1, 3], 3, 7, "always"), ([1, 1, 2], 5, 5, "never"),
    ([4], 3, 8, "always"), ([3, 1], 1, 6, "except_last"),
])
def test_gpipe_equals_the_unsplit_model(balance, chunks, batch, checkpoint):
    devices = [f"/CPU:{j + 1}" for j in range(len(balance))]
    pipe = hvd.Pipeline(layers(), balance, devices, chunks=chunks, checkpoint=checkpoint)
    x = tf.random.normal((batch, 6), seed=2)
    pipe(x)
    assert_same(grads(pipe, x), grads(reference_of(pipe), x))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_in_a_tf_function_with_unknown_batch(checkpoint):
    pipe = hvd.Pipeline(layers(), [2, 2], ["/CPU:1", "/CPU:2"], chunks=3, checkpoint=checkpoint)
    pipe.build((None, 6))
    reference = reference_of(pipe)
    step = tf.function(lambda x: grads(pipe, x), input_signature=[tf.TensorSpec((None, 6), tf.float32)])
    for batch in (9, 7):
        x = tf.random.normal((batch, 6), seed=batch)
        assert_same(step(x), grads(reference, x))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"batch is smaller than chunks \(chunks: 3\)"):
        step(tf.zeros((2, 6)))


def test_fit_with_uneven_last_batch_equals_the_unsplit_model():
    pipe = hvd.Pipeline(layers(), [1, 3], ["/CPU:1", "/CPU:2"], chunks=4)
    pipe.build((None, 6))
    reference = reference_of(pipe)
    rng = np.random.RandomState(0)
    x, y = rng.randn(22, 6).astype("float32"), rng.randn(22, 3).astype("float32")
    for model in (pipe, reference):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # batches 8, 8, 6
    for a, b in zip(pipe.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_eager_timeline_records_every_cell():
    pipe = hvd.Pipeline(layers(), [2, 2], ["/CPU:1", "/CPU:2"], chunks=3, checkpoint="except_last")
    x = tf.random.normal((6, 6))
    pipe(x)
    with pipe.record() as timeline:
        _, g = grads(pipe, x)
    assert_same((pipe(x), g), grads(reference_of(pipe), x))
    assert sorted((e.kind, e.micro_batch, e.stage) for e in timeline.events) == sorted(
        (k, i, j) for k in "FB" for i in range(3) for j in range(2))
    assert {e.device for e in timeline.events} == {"/CPU:1", "/CPU:2"}
    assert "theoretical (n-1)/(m+n-1) = 0.250" in timeline.summary()


def last_first(stages, chunks):
    """GPipe with the micro-batches taken last first (F2 F1 F0 B0 B1 B2): registered for the test only."""
    return [sorted(actions, key=lambda a: (a.kind == "B", -a.micro if a.kind == "F" else a.micro))
            for actions in gpipe(stages, chunks)]


@pytest.fixture
def reversed_schedule():
    register("last-first", last_first, one_process=True)
    yield "last-first"
    unregister("last-first")


def test_a_registered_schedule_runs_in_its_order_and_equals_the_unsplit_model(reversed_schedule):
    m, n = 3, 2
    pipe = hvd.Pipeline(layers(), [2, 2], ["/CPU:1", "/CPU:2"], chunks=m, checkpoint="never",
                        schedule=reversed_schedule)
    x = tf.random.normal((7, 6), seed=4)
    pipe(x)
    with pipe.record() as timeline:
        result = grads(pipe, x)
    assert_same(result, grads(reference_of(pipe), x))
    forward = sorted((e for e in timeline.events if e.kind == "F"), key=lambda e: e.start)
    assert [(e.micro_batch, e.stage) for e in forward] == [
        c for t in one_process_ticks(reversed_schedule, m, n, "F") for c in t]
    assert [e.micro_batch for e in forward if e.stage == 0] == [2, 1, 0]
    assert pipe.schedule == "last-first"


def test_1f1b_is_refused_by_name_before_any_variable_with_the_reason_and_what_to_use():
    model_layers = layers()
    with pytest.raises(ScheduleError) as error:
        hvd.Pipeline(model_layers, [2, 2], ["/CPU:1", "/CPU:2"], chunks=4, schedule="1f1b")
    assert str(error.value).startswith(
        "the one-process Pipeline cannot run schedule '1f1b': 1f1b interleaves backward with forward")
    assert "use schedule='gpipe' here, or DistributedPipeline(..., schedule='1f1b', loss_fn=...)" in str(error.value)
    assert not any(layer.built for layer in model_layers)
    with pytest.raises(ScheduleError, match=r"cannot run schedule 'zb-h1': zb-h1 interleaves backward with forward as "
                                            r"1f1b does .* DistributedPipeline\(\.\.\., schedule='zb-h1', loss_fn=\.\.\.\)"):
        hvd.Pipeline(model_layers, [2, 2], ["/CPU:1", "/CPU:2"], chunks=4, schedule="zb-h1")
    assert not any(layer.built for layer in model_layers)
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        hvd.Pipeline(layers(), [2, 2], ["/CPU:1", "/CPU:2"], schedule="zigzag")


class Boom(keras.layers.Layer):
    def call(self, x):
        if x.shape[0] == 2:  # the last, smaller micro-batch
            raise RuntimeError("bad rows")
        return x


def test_a_failing_layer_names_its_cell():
    pipe = hvd.Pipeline(layers()[:2] + [Boom()], [2, 1], ["/CPU:1", "/CPU:2"], chunks=3)
    with pytest.raises(StageError, match=r"stage 1 failed on micro-batch 2 \(F2 at tick 3\): RuntimeError: (?s:.*)bad rows") as info:
        pipe(tf.zeros((8, 6)))
    assert ">F2<" in str(info.value)


class Counted(keras.layers.Layer):
    """A Dense that counts its (eager) calls."""

    def __init__(self):
        super().__init__()
        self.dense, self.calls = keras.layers.Dense(4, activation="tanh"), 0

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        self.calls += 1
        return self.dense(x)


@pytest.mark.parametrize("checkpoint, replays", [("never", 0), ("except_last", 2), ("always", 3)])
def test_checkpointed_micro_batches_run_their_stages_again_in_backward_only(checkpoint, replays):
    counted = [Counted(), Counted()]
    pipe = hvd.Pipeline(counted, [1, 1], ["/CPU:1", "/CPU:2"], chunks=3, checkpoint=checkpoint)
    x = tf.random.normal((6, 4), seed=3)
    pipe(x)  # builds the layers (a symbolic call each)
    for layer in counted:
        layer.calls = 0
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(pipe(x, training=True) ** 2)
    assert [layer.calls for layer in counted] == [3, 3]
    tape.gradient(loss, pipe.trainable_variables)
    assert [layer.calls for layer in counted] == [3 + replays, 3 + replays]

"""dualframe.tensorflow.Pipeline: GPipe results equal the unsplit model's for balances, chunks, checkpoint modes."""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.errors import StageError

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

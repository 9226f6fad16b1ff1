"""A Keras pipeline stage's Embedding gradient stays IndexedSlices, as in plain Keras: Adam then trains alike (one process)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.tensorflow.pipeline.sparse import SparseParts, added

STEPS, ROWS, CHUNKS = 3, 16, 4


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 8),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(8, "tanh"), keras.layers.Dense(3)])


def batches():
    rng = np.random.RandomState(1)
    return [(rng.randint(0, 20, (ROWS, 5)).astype("int32"), rng.randn(ROWS, 3).astype("float32")) for _ in range(STEPS)]


def plain_keras(data):
    """Tape + apply_gradients with the gradients as Keras gives them (the Embedding's IndexedSlices)."""
    model, optimizer, losses = make_model(), keras.optimizers.Adam(0.01), []
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


def test_sparse_parts_concatenate_and_a_dense_part_densifies():
    a = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([3]), tf.constant([5, 2]))
    b = tf.IndexedSlices(tf.constant([[4.0, 8.0]]), tf.constant([3]), tf.constant([5, 2]))
    parts = SparseParts()
    sums = parts.keep([a, tf.ones(2)])
    sums = [added(s, g) for s, g in zip(sums, parts.keep([b, tf.ones(2)]))]
    assert sums[0] is None and sums[1].numpy().tolist() == [2.0, 2.0]
    joined = parts.joined(sums)
    assert isinstance(joined[0], tf.IndexedSlices) and joined[0].indices.numpy().tolist() == [3, 3]
    np.testing.assert_array_equal(joined[0].values.numpy(), [[1.0, 2.0], [4.0, 8.0]])
    mixed = added(joined[0], tf.ones((5, 2)))  # a tied weight's dense share: the sum turns dense
    np.testing.assert_array_equal(mixed.numpy()[3], [6.0, 11.0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_pipeline_with_an_embedding_under_adam_equals_plain_keras(schedule):
    """Taped, fused and split passes alike: the step's Embedding gradient is one IndexedSlices listing every
    micro-batch's rows, so Adam updates (and decays) only those rows, as ``apply_gradients`` after one tape."""
    hvd.init()
    data = batches()
    losses, weights = plain_keras(data)
    pipe = hvd.DistributedPipeline(make_model(), [4], chunks=CHUNKS, schedule=schedule, loss_fn="mse")
    optimizer = keras.optimizers.Adam(0.01)
    for step, (x, y) in enumerate(data):
        loss = pipe.train_step(x, y)
        assert isinstance(pipe.gradients[0], tf.IndexedSlices) and pipe.gradients[0].indices.shape[0] == ROWS * 5
        pipe.apply_gradients(optimizer)
        assert loss == pytest.approx(losses[step], abs=1e-5)
    for got, want in zip(pipe.gather_weights(), weights):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

"""TensorFlow DistributedPipeline of a functional Keras model (residual blocks) on 2 processes, against one process.
# timeout: 400

Cut at a block's output, one tensor crosses; cut inside a block, two do (the skip and the main
path), packed into one byte message. GPipe, 1F1B and ZB-H1 (its B and W split node by node,
``dualframe.tensorflow.pipeline.graph_backward``), the residual net and the attention encoder with a mask. Skips over a stage and several outputs: mp_tf_graph_pipeline.py.
"""
import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
from dualframe.pipeline.graph_walk import edge_values
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import (T, assert_weights, batches, embedding_batches, encoder_batches, make_embedding_model,
                                   make_encoder, one_process, train_pipeline)

STEPS, BATCH, CHUNKS = 3, 10, 4
hvd.init()


def make_model(seed=7):
    """input -> dense -> 2 residual blocks -> head, seeded so every rank and the reference agree (9 layers)."""
    init = keras.initializers.GlorotUniform
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, kernel_initializer=init(seed), name="d0")(x)
    for b in range(2):
        f = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(seed + 10 * b + 1), name=f"b{b}_fc1")(h)
        f = keras.layers.Dense(16, kernel_initializer=init(seed + 10 * b + 2), name=f"b{b}_fc2")(f)
        h = keras.layers.Add(name=f"b{b}_add")([h, f])
    return keras.Model(x, keras.layers.Dense(3, kernel_initializer=init(seed + 99), name="head")(h))


@pytest.mark.parametrize("schedule, balance, checkpoint", [
    ("gpipe", [5, 4], "never"), ("1f1b", [5, 4], "never"), ("1f1b", [3, 6], "never"), ("zb-h1", [5, 4], "never"),
    ("zb-h1", [3, 6], "never"), ("gpipe", [5, 4], "always"), ("1f1b", [3, 6], "except_last"),
    ("zb-h1", [3, 6], "always")])
def test_functional_model_trains_as_one_process(schedule, balance, checkpoint):
    """checkpoint=: each stage recomputes its micro-batches' forward in their backward, with the same results."""
    data = batches(STEPS, BATCH)
    expected_losses, expected_weights = one_process(make_model(), data, keras.optimizers.SGD(0.1, momentum=0.9))
    pipe = DistributedPipeline(make_model(), balance=balance, chunks=CHUNKS, schedule=schedule, loss_fn="mse",
                               checkpoint=checkpoint)
    crossing = {(0, 1): ("b0_fc1", "d0") if balance == [3, 6] else ("b0_add",)}  # two values cross at [3, 6]
    assert pipe.role.edge_links.keys() == {1 - pipe.stage_index}
    assert {(0, 1): edge_values(pipe.split, 0, 1)} == crossing
    train_pipeline(pipe, keras.optimizers.SGD(0.1, momentum=0.9), data, expected_losses)
    assert_weights(pipe.gather_weights(), expected_weights)


def test_inference_and_set_weights_take_the_full_model():
    other = make_model(seed=99)
    pipe = DistributedPipeline(make_model(), balance=[5, 4], chunks=3, loss_fn="mse")
    pipe.set_weights(other.get_weights())
    x = np.random.RandomState(3).randn(7, 6).astype("float32")
    out = pipe(x)
    if pipe.is_last:
        np.testing.assert_allclose(out.numpy(), other(x).numpy(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 3), ("zb-h1", 4)])
def test_encoder_with_two_inputs_and_a_mask_crossing_trains_as_one_process(schedule, chunks):
    data = encoder_batches(STEPS, BATCH)
    expected_losses, expected_weights = one_process(make_encoder(), data, keras.optimizers.SGD(0.1))
    # inputs, mask, embedding, block 0 (3 layers) | block 1, pool, head: the states and the bool mask cross, packed
    pipe = DistributedPipeline(make_encoder(), balance=[7, 5], chunks=chunks, schedule=schedule, loss_fn="mse")
    train_pipeline(pipe, keras.optimizers.SGD(0.1), data, expected_losses)
    assert (pipe._graph_function.weight_pass.tracing_count() > 0) == (schedule == "zb-h1")  # W ran, compiled
    assert_weights(pipe.gather_weights(), expected_weights)



@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_embedding_under_adam_trains_as_plain_keras(schedule):
    """The Embedding's gradient reaches Adam as one IndexedSlices listing every micro-batch's rows, as plain Keras's
    tape gives it (made dense, Adam would update every row and the weights would differ)."""
    data = embedding_batches(STEPS, BATCH)
    expected_losses, expected_weights = one_process(make_embedding_model(), data, keras.optimizers.Adam(0.01))
    pipe = DistributedPipeline(make_embedding_model(), balance=[2, 2], chunks=CHUNKS, schedule=schedule, loss_fn="mse")
    train_pipeline(pipe, keras.optimizers.Adam(0.01), data, expected_losses)
    if pipe.is_first:  # every token of the batch, one row each
        assert type(pipe.gradients[0]).__name__ == "IndexedSlices" and pipe.gradients[0].indices.shape[0] == BATCH * T
    assert_weights(pipe.gather_weights(), expected_weights)

"""Keras hybrid on 4 processes: 2 replicas x 2 stages, GPipe and 1F1B, against one process training the whole model on the global batch."""
# np: 4
# timeout: 400
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.rank_schedule import pipeline_process_sets
from dualframe.tensorflow.distributed_pipeline import DistributedPipeline

STEPS, GLOBAL_BATCH, CHUNKS = 3, 16, 4  # each replica 8 rows: micro-batches of 2
# The process sets the pipeline needs, declared at start-up: neighbour pairs, pipelines, stage replicas.
hvd.init(process_sets=pipeline_process_sets(4, 2))


def make_model(seed=3):
    """The same weights on every rank and in the reference: seeded initializers, built by keras.Input."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(12, kernel_initializer=init(seed), bias_initializer=keras.initializers.RandomNormal(seed=seed)),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(12, kernel_initializer=init(seed + 1)),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(2, kernel_initializer=init(seed + 2)),
    ])


def global_batches():
    rng = np.random.RandomState(5)
    return [(rng.randn(GLOBAL_BATCH, 5).astype("float32"), rng.randn(GLOBAL_BATCH, 2).astype("float32"))
            for _ in range(STEPS)]


def reference(data):
    """One process trains the whole model on the global batches: losses and final weights."""
    model, optimizer, losses = make_model(), keras.optimizers.SGD(0.2, momentum=0.9), []
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


def test_started_on_four_processes():
    assert hvd.size() == 4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hybrid_equals_one_process_on_the_global_batch(schedule):
    data = global_batches()
    expected_losses, expected_weights = reference(data)
    pipe = DistributedPipeline(make_model(), balance=[3, 2], chunks=CHUNKS, schedule=schedule, loss_fn="mse",
                               data_parallel=2)
    assert (pipe.replica, pipe.stage_index) == divmod(hvd.rank(), 2)
    assert pipe.stage_ranks == [pipe.stage_index, 2 + pipe.stage_index]
    optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.2, momentum=0.9))
    rows = GLOBAL_BATCH // 2
    for step, (x, y) in enumerate(data):
        shard = slice(pipe.replica * rows, (pipe.replica + 1) * rows)  # each replica its half of the global batch
        loss = pipe.train_step(x[shard], y[shard])
        pipe.apply_gradients(optimizer)
        assert loss == pytest.approx(expected_losses[step], abs=1e-5), f"step {step}"
    # Each replica's pipeline merges into the full model; both replicas hold the same weights.
    merged = pipe.gather_weights()
    assert len(merged) == len(expected_weights)
    for got, want in zip(merged, expected_weights):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    replicas = hvd.allgather_object(pipe.get_weights(), name=f"hybrid.{schedule}.weights")
    for got, want in zip(replicas[pipe.stage_index], replicas[2 + pipe.stage_index]):
        np.testing.assert_array_equal(got, want)

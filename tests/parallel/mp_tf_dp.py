"""TensorFlow/Keras 3 data parallelism under a launcher: every rank ends equal to one-process training.

Each rank starts from its OWN random weights (seed 100 + rank); the reference is computed inside
every rank: one process training rank 0's initial model on the concatenation of all ranks' batches.
The sharded optimizer (ZeRO-1/2, ``DistributedOptimizer(shard=...)``) is checked in mp_tf_shard.py.
# timeout: 600
"""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe
import dualframe.tensorflow.keras as hvd
# tests/parallel is on sys.path (pytest rootdir import)
from keras_dp_helpers import (FEATURES, PER_RANK, SEED0, STEPS, assert_equal_on_all_ranks, data, flat, make_model,
                              one_process_fit, rank_fit, rank_rows)

hvd.init()
SIZE, RANK = hvd.size(), hvd.rank()


def reference(optimizer, x, y, batch, epochs=1, norm=None, initial=None):
    model = make_model(SEED0, norm)
    if initial is not None:
        model.set_weights(initial)
    return one_process_fit(model, optimizer, x, y, batch, epochs)


def distributed_fit(optimizer, x, y, epochs=1, norm=None, built=True):
    return rank_fit(make_model(SEED0 + RANK, norm, built), optimizer, x, y, epochs)


def test_ranks_start_different():
    assert SIZE == 2
    gathered = hvd.allgather(tf.constant(flat(make_model(SEED0 + RANK))[None])).numpy()
    assert np.abs(gathered[0] - gathered[1]).max() > 0.1


def test_fit_sgd_with_lr_schedule_equals_one_process():
    x, y = data()
    lr = lambda: keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.7)  # noqa: E731
    model = distributed_fit(hvd.DistributedOptimizer(keras.optimizers.SGD(lr(), momentum=0.9)), x, y, epochs=2)
    ref = reference(keras.optimizers.SGD(lr(), momentum=0.9), x, y, PER_RANK * SIZE, epochs=2)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-4)
    assert np.abs(flat(ref) - flat(make_model(SEED0))).max() > 1e-2  # training moved the weights


def test_model_built_by_fit_is_broadcast_after_the_first_batch():
    x, y = data(seed=10)
    model = distributed_fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), x, y, built=False)
    assert_equal_on_all_ranks(model)  # no variables before fit traced step 1: equal from step 2 on


def test_fit_adam_broadcasts_optimizer_state_before_first_update():
    x, y = data(seed=1)

    def compiled_state(model, rank):
        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)
        rng = np.random.RandomState(7 + rank)
        inner = optimizer.inner_optimizer if hasattr(optimizer, "inner_optimizer") else optimizer
        for v in inner.variables:
            if "momentum" in v.path or "velocity" in v.path:
                v.assign(rng.uniform(0.0, 0.01, v.shape).astype("float32"))
        inner.iterations.assign(3 + rank)

    model = make_model(SEED0 + RANK)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    compiled_state(model, RANK)
    model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = make_model(SEED0)
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    compiled_state(ref, 0)
    ref.fit(x, y, batch_size=PER_RANK * SIZE, shuffle=False, verbose=0)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-4)
    assert int(model.optimizer.iterations) == 3 + STEPS
    for mine, theirs in zip(model.optimizer.inner_optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), atol=1e-4, err_msg=mine.path)


def test_gradient_tape_loop_equals_one_process():
    x, y = data(seed=2)
    model, optimizer = make_model(SEED0 + RANK), keras.optimizers.SGD(0.1)
    hvd.broadcast_variables(model.variables, root_rank=0)
    xs, ys = rank_rows(x), rank_rows(y)
    for k in range(STEPS):
        rows = slice(k * PER_RANK, (k + 1) * PER_RANK)
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(ys[rows], model(xs[rows], training=True))
            loss = tf.reduce_mean(loss)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    ref = reference(keras.optimizers.SGD(0.1), x, y, PER_RANK * SIZE)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-4)


class CustomStep(keras.Sequential):
    """A model whose train_step is written by hand, calling the optimizer as Keras's guide does."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_custom_train_step_equals_one_process():
    x, y = data(seed=3)
    model = make_model(SEED0 + RANK, cls=CustomStep)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(reference(keras.optimizers.SGD(0.1), x, y, PER_RANK * SIZE)),
                               atol=1e-4)


def test_backward_passes_per_step_2_equals_one_process_on_both_passes():
    x, y = data(steps=2 * STEPS, seed=4)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    model = distributed_fit(opt, x, y)
    ref = reference(keras.optimizers.SGD(0.1, momentum=0.5), x, y, 2 * PER_RANK * SIZE)
    assert_equal_on_all_ranks(model)
    assert int(model.optimizer.iterations) == STEPS
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-4)


def test_fp16_compression_within_fp16_tolerance():
    x, y = data(seed=5)
    model = distributed_fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16),
                            x, y)
    ref = reference(keras.optimizers.SGD(0.1), x, y, PER_RANK * SIZE)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=3e-3)
    assert np.abs(flat(model) - flat(ref)).max() > 0  # the gradients really went through float16


def test_sync_batch_norm_equals_batch_norm_on_the_global_batch():
    x, y = data(seed=6)
    model = distributed_fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), x, y,
                            norm=lambda: hvd.SyncBatchNormalization(momentum=0.8))
    initial = make_model(SEED0, lambda: hvd.SyncBatchNormalization()).get_weights()
    ref = reference(keras.optimizers.SGD(0.1), x, y, PER_RANK * SIZE,
                    norm=lambda: keras.layers.BatchNormalization(momentum=0.8), initial=initial)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-4)  # includes moving mean and variance


def test_mixed_precision_loss_scale_optimizer():
    x, y = data(seed=7)
    scaled = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 8)  # noqa
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = distributed_fit(hvd.DistributedOptimizer(scaled()), x, y)
        ref = reference(scaled(), x, y, PER_RANK * SIZE)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, hvd.DistributedLossScaleOptimizer)
    assert_equal_on_all_ranks(model)
    assert float(model.optimizer.dynamic_scale) == float(ref.optimizer.dynamic_scale) == 2.0 ** 8  # no step skipped
    np.testing.assert_allclose(flat(model), flat(ref), atol=2e-2)


def test_strategy_path_distribute_data_parallel():
    x, y = data(seed=8)
    model = make_model(SEED0 + RANK)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model = hvd.distribute(model, dualframe.DataParallel(backward_passes_per_step=1))
    model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(reference(keras.optimizers.SGD(0.1), x, y, PER_RANK * SIZE)),
                               atol=1e-4)


def test_partial_tape_keeps_local_layer_gradients_local():
    model = make_model(SEED0)
    x, y = data(steps=1, seed=9)
    xs, ys = rank_rows(x), rank_rows(y)

    def loss_and_tape(tape_factory):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xs) - ys))
        return loss, tape_factory(tape)

    loss, plain = loss_and_tape(lambda t: t)
    local = [g.numpy() for g in plain.gradient(loss, model.trainable_variables)]
    loss, partial = loss_and_tape(lambda t: hvd.PartialDistributedGradientTape(t, local_layers=model.layers[-1]))
    grads = [g.numpy() for g in partial.gradient(loss, model.trainable_variables)]
    everyone = hvd.allgather_object(local)
    for i, grad in enumerate(grads):
        expected = local[i] / SIZE if i >= 2 else np.mean([g[i] for g in everyone], axis=0)
        np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)


def test_metric_average_objects_and_shard():
    logs = {"loss": float(RANK + 1), "accuracy": 10.0 * RANK}
    hvd.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    assert logs == {"loss": 1.5, "accuracy": 5.0}
    assert hvd.broadcast_object({"from": RANK}, root_rank=1) == {"from": 1}
    assert hvd.allgather_object(RANK * 3) == [0, 3]
    hvd.barrier()
    shard = list(hvd.shard(tf.data.Dataset.range(11)).as_numpy_iterator())
    assert shard == list(range(RANK, 10, SIZE))


def test_bad_input_fails_before_any_communication():
    model = make_model(SEED0)
    with pytest.raises(dualframe.StrategyError, match="root_rank must be an int in"):
        hvd.broadcast_variables(model.variables, root_rank=SIZE)
    with pytest.raises(dualframe.StrategyError, match="unknown op"):
        hvd.allreduce(tf.ones(2), op="mean")
    with pytest.raises(dualframe.StrategyError, match="unknown compression"):
        hvd.DistributedGradientTape(tf.GradientTape(), compression="int8")
    # Nothing was sent: the next collective pairs up on every rank.
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == SIZE


def test_broadcast_callback_keeps_local_variables():
    # Horovod's BroadcastGlobalVariablesCallback(root_rank, local_variables=...): those stay per rank.
    def layer():
        return keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(float(RANK)),
                                  bias_initializer=keras.initializers.Constant(float(RANK)))
    model = keras.Sequential([keras.Input((3,)), layer(), layer()])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    kept = list(model.layers[0].variables)
    root = SIZE - 1
    model.fit(np.ones((2, 3), "float32"), np.ones((2, 3), "float32"), verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=kept)])
    for variable in model.variables:
        expected = float(RANK) if any(variable is k for k in kept) else float(root)
        np.testing.assert_array_equal(variable.numpy(), np.full(variable.shape, expected, "float32"))


def test_tape_elastic_state_sync_makes_model_and_optimizer_rank_zeros():
    # hvd.elastic.TensorFlowKerasState(model, optimizer) (Horovod's GradientTape elastic example) on Keras 3.
    keras.utils.set_random_seed(SEED0 + RANK)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.1)
    with tf.GradientTape() as tape:  # a local step: Adam's slots and iteration count now differ per rank
        loss = tf.reduce_mean(model(np.full((2, FEATURES), RANK + 1.0, "float32")) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    state = dualframe.tensorflow.reliability.elastic.TensorFlowKerasState(model, optimizer, batch=10 + RANK)
    state.sync()
    values = [v.numpy() for v in model.variables + optimizer.variables]
    for mine, root in zip(values, hvd.broadcast_object(values, root_rank=0)):
        np.testing.assert_array_equal(mine, root)
    assert state.batch == 10

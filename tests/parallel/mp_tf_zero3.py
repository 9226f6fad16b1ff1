"""Keras ZeRO-3 (``shard="parameters"``) on 2 ranks: equal to plain data parallelism, 1/N of its bytes per rank.

Every rank runs every test. Each compares with plain data parallelism's one-process reference (rank 0's
initial model trained on the concatenation of all ranks' batches, computed inside every rank) to 1e-5,
float32. The model is functional with a residual Add, a LayerNormalization and a frozen Dense (its kernel
is a non-trainable variable: replicated, not sharded).
# timeout: 600
"""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe
import dualframe.tensorflow.keras as hvd
# tests/parallel is on sys.path (pytest rootdir import)
from keras_dp_helpers import FEATURES, PER_RANK, SEED0, data, one_process_fit, rank_rows

SINGLES = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
hvd.init(process_sets=SINGLES)
SIZE, RANK = hvd.size(), hvd.rank()
STEPS = 3

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


def zero3_model(seed):
    """Dense -> (Dense branch) Add -> LayerNormalization -> frozen Dense -> Dense."""
    keras.utils.set_random_seed(seed)
    init = keras.initializers.GlorotUniform
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(seed))(inputs)
    branch = keras.layers.Dense(16, kernel_initializer=init(seed + 1))(hidden)
    normed = keras.layers.LayerNormalization()(keras.layers.Add()([hidden, branch]))
    frozen = keras.layers.Dense(8, kernel_initializer=init(seed + 2), trainable=False)(normed)
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer=init(seed + 3))(frozen))


def weights(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def assert_same_on_all_ranks(flat):
    gathered = hvd.allgather(tf.constant(flat[None])).numpy()
    for row in gathered[1:]:
        np.testing.assert_array_equal(row, gathered[0])


def reference(name, x, y, batch, seed=SEED0):
    return one_process_fit(zero3_model(seed), OPTIMIZERS[name](), x, y, batch)


def test_distribute_parameters_is_checked_before_any_communication():
    """Bad input is refused by name on every rank alike, and nothing was sent: the next collective pairs up."""
    with pytest.raises(dualframe.StrategyError, match="unknown shard 'weights'.*'parameters' \\(ZeRO-3\\)"):
        dualframe.DataParallel(shard="weights")
    with pytest.raises(dualframe.StrategyError, match="loss scaling"):
        hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), shard="parameters")
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(dualframe.StrategyError, match="build the model before shard_model"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="parameters").shard_model(unbuilt)
    with pytest.raises(dualframe.StrategyError, match="shard_model needs .*shard='parameters'"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="gradients").shard_model(zero3_model(SEED0))
    with pytest.raises(dualframe.StrategyError, match="root_rank must be an int in \\[0, 2\\)"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="parameters").shard_model(zero3_model(SEED0), 5)
    # A layer shared by two nested models (the rebuilt model would not share it): refused before the broadcast.
    inputs = keras.Input((FEATURES,))
    shared = keras.layers.Dense(FEATURES)
    twice = keras.Model(inputs, keras.layers.Dense(1)(shared(inputs)))
    nested = keras.Model(inputs, twice(keras.Sequential([shared])(inputs)))
    with pytest.raises(dualframe.StrategyError, match="does not keep a layer shared between nested models"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="parameters").shard_model(nested)
    # Compiled with it, but the model never sharded: refused when fit builds the optimizer, before any step.
    plain = zero3_model(SEED0)
    plain.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="parameters"), loss="mse")
    x, y = data(steps=1, seed=30)
    with pytest.raises(dualframe.StrategyError, match="model = opt.shard_model\\(model\\)"):
        plain.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, verbose=0)
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == SIZE


@pytest.mark.parametrize("name,passes", [("sgd", 1), ("adam", 1), ("adam", 2)])
def test_fit_equals_plain_data_parallelism_with_a_fraction_of_the_bytes(name, passes):
    x, y = data(steps=passes * STEPS, seed=31)
    model = zero3_model(SEED0 + RANK)  # every rank its own weights: both entries broadcast rank 0's
    if passes == 1:  # the strategy entry
        model.compile(optimizer=OPTIMIZERS[name](), loss="mse")
        model = hvd.distribute(model, dualframe.DataParallel(shard="parameters"))
    else:  # the optimizer entry, averaging the passes as the reference's larger batch does
        opt = hvd.DistributedOptimizer(OPTIMIZERS[name](), shard="parameters", backward_passes_per_step=passes,
                                       average_aggregated_gradients=True)
        model = opt.shard_model(model)
        model.compile(optimizer=opt, loss="mse")
    history = model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0)
    ref = reference(name, x, y, passes * PER_RANK * SIZE)
    flat = weights(model)
    assert_same_on_all_ranks(flat)
    np.testing.assert_allclose(flat, weights(ref), atol=1e-5)
    assert int(model.optimizer.iterations) == STEPS
    assert np.isfinite(history.history["loss"][0]) and history.history["loss"][0] > 0
    # The model's own variables never held values (Keras's placeholders, private: the test looks inside),
    # and each layer with weights has buckets of its own (what it gathers alone).
    assert all(v._value is None for v in model.trainable_variables)
    layers = [layer for layer in model.layers if layer.trainable_variables]
    assert len(model.optimizer._zero.layout.buckets) == len(layers) == 4
    # Per rank: parameter slices + optimizer slots + accumulated gradient slices = 1/N of plain's.
    trainable = sum(int(np.prod(v.shape)) for v in ref.trainable_variables) * 4
    slots = sum(int(np.prod(v.shape)) * 4 for v in ref.optimizer.variables if len(v.shape))
    accumulated = trainable if passes > 1 else 0
    kept = model.optimizer.parameter_bytes() + model.optimizer.state_bytes() + accumulated // SIZE
    assert kept <= (trainable + slots + accumulated) // SIZE + 64 * (2 + len(ref.optimizer.variables))
    assert kept < (trainable + slots + accumulated) * 0.6


@pytest.mark.parametrize("traced", [True, False])
def test_gradient_tape_loop_equals_plain_data_parallelism(traced):
    x, y = data(steps=STEPS, seed=32)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard="parameters")
    model = opt.shard_model(zero3_model(SEED0 + RANK), root_rank=0)

    def step(xb, yb):
        with tf.GradientTape() as tape:  # each layer gathers its values for its call, and again for its backward
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        slices = opt.parameter_slices()
        opt.apply(tape.gradient(loss, slices), slices)  # already reduce-scattered: only the update is left

    step = tf.function(step) if traced else step
    xs, ys = rank_rows(x), rank_rows(y)
    for k in range(STEPS):
        step(xs[k * PER_RANK:(k + 1) * PER_RANK], ys[k * PER_RANK:(k + 1) * PER_RANK])
    flat = weights(model)
    assert_same_on_all_ranks(flat)
    np.testing.assert_allclose(flat, weights(reference("adam", x, y, PER_RANK * SIZE)), atol=1e-5)


def test_over_a_process_set_uses_the_sets_size_and_rank():
    # Each rank's set is itself alone: it trains on its own rows as one process would.
    x, y = data(steps=STEPS, seed=33)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), shard="parameters",
                                   process_set=SINGLES[RANK])
    model = opt.shard_model(zero3_model(SEED0 + RANK))
    model.compile(optimizer=opt, loss="mse")
    model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0)
    ref = reference("sgd", rank_rows(x), rank_rows(y), PER_RANK, seed=SEED0 + RANK)
    np.testing.assert_allclose(weights(model), weights(ref), atol=1e-5)
    assert model.optimizer.parameter_bytes() == sum(int(np.prod(v.shape)) * 4 for v in ref.trainable_variables)


def test_save_weights_is_plain_keras_and_resumes_on_another_number_of_ranks(tmp_path_factory):
    x, y = data(steps=2 * STEPS, seed=34)
    first, second = slice(0, STEPS * PER_RANK), slice(STEPS * PER_RANK, None)
    model = zero3_model(SEED0 + RANK)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model = hvd.distribute(model, dualframe.DataParallel(shard="parameters"))
    model.fit(rank_rows(x)[first], rank_rows(y)[first], batch_size=PER_RANK, shuffle=False, verbose=0)
    path = hvd.allgather_object(str(tmp_path_factory.mktemp(f"rank{RANK}") / "zero3.weights.h5"))[0]
    model.save_weights(path)  # every rank gathers; rank 0 writes
    hvd.barrier()
    # What would read the variables' placeholders is refused (no communication before it).
    with pytest.raises(dualframe.StrategyError, match="model.save of a shard='parameters'"):
        model.save(path.replace(".weights.h5", ".keras"))
    with pytest.raises(ValueError, match="ZeRO-3"):  # a CheckpointError
        hvd.save_checkpoint(str(tmp_path_factory.mktemp("ckpt")), model, step=STEPS)
    plain = zero3_model(SEED0 + 7)
    plain.load_weights(path)  # plain Keras reads it: the unsharded layout
    np.testing.assert_array_equal(weights(plain), weights(model))
    # Resume on one rank (each rank alone in its set) and train on all the remaining rows there ...
    alone = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="parameters", process_set=SINGLES[RANK])
    resumed = alone.shard_model(zero3_model(SEED0 + 9))
    resumed.load_weights(path)
    np.testing.assert_array_equal(weights(resumed), weights(model))
    resumed.compile(optimizer=alone, loss="mse")
    resumed.fit(x[STEPS * PER_RANK * SIZE:], y[STEPS * PER_RANK * SIZE:], batch_size=PER_RANK * SIZE, shuffle=False, verbose=0)
    # ... as the 2-rank job goes on: the same weights.
    model.fit(rank_rows(x)[second], rank_rows(y)[second], batch_size=PER_RANK, shuffle=False, verbose=0)
    np.testing.assert_allclose(weights(resumed), weights(model), atol=1e-5)

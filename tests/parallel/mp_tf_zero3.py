"""Keras ZeRO-3 (``shard="parameters"``) on 2 ranks: equal to plain data parallelism, 1/N of its bytes per rank.

Every rank runs every test. Each compares with plain data parallelism's one-process reference (rank 0's
initial model trained on the concatenation of all ranks' batches, computed inside every rank) to 1e-5,
float32. The model is functional with a residual Add, a LayerNormalization and a frozen Dense (its kernel
is a non-trainable variable: replicated, not sharded). The mixed-precision tests (mixed_float16 with loss
scaling, mixed_bfloat16, float16 variables) compare with one process under the same policy to 1e-3 or 2e-3
(MIXED_TOLERANCE says why), the loss scale exactly.
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


# --- mixed_float16: fp32 master slices, float16 compute, one loss scale for every rank -------------------------
# Compared with ONE process running Keras's own LossScaleOptimizer under mixed_float16 on the full batch, to
# 1e-3: both compute each layer in float16 from the same float32 values (in one process, eager, the slices'
# gradients equal plain Keras's bit for bit: tests/tensorflow/test_zero3_keras.py), but here each rank sums
# 4 rows' gradients in float16 where the one process sums 8, the ranks average in float32, and the plain
# model's traced step uses oneDNN's fused kernels; float16 keeps ~3 decimal digits. Measured after 3 steps:
# 1e-5 to 7e-5, and 4.4e-4 for SGD+momentum after a skipped step (weights ~1).
MIXED_TOLERANCE = 1e-3


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    yield
    keras.mixed_precision.set_dtype_policy("float32")


def loss_scaled(name, initial_scale=1024.0, growth=2):
    return keras.optimizers.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=initial_scale,
                                               dynamic_growth_steps=growth)


def fit_reference(optimizer, x, y, batch, sample_weight=None):
    """One process, all rows: compile wraps a plain optimizer in Keras's LossScaleOptimizer (the policy's)."""
    model = zero3_model(SEED0)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=batch, shuffle=False, verbose=0)
    return model, history.history["loss"][0]


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_mixed_float16_fit_equals_one_process_loss_scale_optimizer(mixed_float16, name):
    """SGD: the policy alone (Keras's default scale); Adam: an explicit LossScaleOptimizer (its settings kept)."""
    x, y = data(steps=STEPS, seed=35)
    make = (lambda: loss_scaled(name)) if name == "adam" else OPTIMIZERS[name]
    opt = hvd.DistributedOptimizer(make(), shard="parameters")
    model = opt.shard_model(zero3_model(SEED0 + RANK))
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0)
    ref, ref_loss = fit_reference(make(), x, y, PER_RANK * SIZE)
    flat = weights(model)
    assert_same_on_all_ranks(flat)
    np.testing.assert_allclose(flat, weights(ref), atol=MIXED_TOLERANCE)
    # fit's loss: each rank's mean of its own rows (the reference: all rows), averaged over the steps.
    mean_loss = float(hvd.allreduce(tf.constant(history.history["loss"][0])))
    np.testing.assert_allclose(mean_loss, ref_loss, rtol=MIXED_TOLERANCE)
    scales = hvd.allgather(tf.reshape(opt.dynamic_scale, [1])).numpy().tolist()
    assert scales == [float(ref.optimizer.dynamic_scale)] * SIZE
    assert int(opt.iterations) == int(ref.optimizer.iterations)
    if name == "adam":
        assert scales[0] == 2048.0 and int(opt.iterations) == STEPS  # grown once in 3 steps, none skipped
    sharded = opt.inner_optimizer
    assert all(s.dtype == "float32" for s in sharded._zero.slices)  # the fp32 masters
    assert all(v.dtype == "float32" and v._value is None for v in model.trainable_variables)
    assert model.layers[1].compute_dtype == "float16"


def test_mixed_bfloat16_fit_equals_one_process():
    """No loss scaling; the same 1e-3 as float16 (measured 1.6e-4 with Adam: bfloat16 keeps fewer digits, but
    Adam's normalised step hides most of the gradients' rounding)."""
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        x, y = data(steps=STEPS, seed=38)
        model = zero3_model(SEED0 + RANK)
        model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
        model = hvd.distribute(model, dualframe.DataParallel(shard="parameters"))
        model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0)
        ref, _ = fit_reference(OPTIMIZERS["adam"](), x, y, PER_RANK * SIZE)
        flat = weights(model)
        assert_same_on_all_ranks(flat)
        np.testing.assert_allclose(flat, weights(ref), atol=MIXED_TOLERANCE)
        assert all(s.dtype == "float32" for s in model.optimizer._zero.slices)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def test_float16_variables_fit_through_fp32_master_slices():
    """Layers with dtype='float16' (float16 variables) at np=2 against one process training the same layers as
    'mixed_float16' (float32 variables) from the same values: the slices are the fp32 masters; 2e-3, as the
    float16 weights are the masters' casts (a float16 step at |w| < 2 is 9.8e-4) besides the rows' sums."""
    def layered(policy, seed):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(16, activation="tanh", dtype=policy)(inputs)
        branch = keras.layers.Dense(16, dtype=policy)(hidden)
        normed = keras.layers.LayerNormalization()(keras.layers.Add(dtype=policy)([hidden, branch]))
        return keras.Model(inputs, keras.layers.Dense(1)(normed))

    x, y = data(steps=STEPS, seed=39)
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adam"](), shard="parameters")
    model = opt.shard_model(layered("float16", SEED0 + RANK))
    ref = layered("mixed_float16", SEED0)
    ref.set_weights(model.get_weights())  # rank 0's values (get_weights gathers: every rank calls)
    model.compile(optimizer=opt, loss="mse")
    model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0)
    one_process_fit(ref, OPTIMIZERS["adam"](), x, y, PER_RANK * SIZE)
    flat = weights(model)
    assert_same_on_all_ranks(flat)
    np.testing.assert_allclose(flat, weights(ref), atol=2e-3)
    assert model.get_weights()[0].dtype == np.float16 and all(s.dtype == "float32" for s in opt._zero.slices)


def test_mixed_float16_through_distribute_skips_an_overflow_on_every_rank(mixed_float16):
    """A huge sample weight on rank 1's rows of step 0 overflows float16 there: both ranks skip and halve."""
    x, y = data(steps=STEPS, seed=36)
    weight = np.ones(len(x), "float32")
    weight[PER_RANK:2 * PER_RANK] = 1e30  # step 0, rank 1's block (rank_rows' order)
    model = zero3_model(SEED0 + RANK)
    model.compile(optimizer=loss_scaled("sgd", growth=2000), loss="mse")
    model = hvd.distribute(model, dualframe.DataParallel(shard="parameters"))
    model.fit(rank_rows(x), rank_rows(y), sample_weight=rank_rows(weight), batch_size=PER_RANK, shuffle=False,
              verbose=0)
    ref, _ = fit_reference(loss_scaled("sgd", growth=2000), x, y, PER_RANK * SIZE, sample_weight=weight)
    assert float(ref.optimizer.dynamic_scale) == 512.0 and int(ref.optimizer.iterations) == STEPS - 1
    scales = hvd.allgather(tf.reshape(model.optimizer.dynamic_scale, [1])).numpy()
    assert scales.tolist() == [512.0] * SIZE  # 1024 halved once, on both ranks
    assert int(model.optimizer.iterations) == STEPS - 1
    flat = weights(model)
    assert_same_on_all_ranks(flat)
    np.testing.assert_allclose(flat, weights(ref), atol=MIXED_TOLERANCE)


def tape_step(opt, model, xb, yb, edit=None):
    """One GradientTape step: the loss scaled by ``opt``, the slices' gradients (already reduced) maybe edited."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.cast(model(xb, training=True), "float32") - yb))
        scaled = opt.scale_loss(loss)
    slices = opt.parameter_slices() if hasattr(opt, "parameter_slices") else model.trainable_variables
    grads = tape.gradient(scaled, slices)
    opt.apply(edit(grads) if edit else grads, slices)


def inf_in_last(grads):
    last = grads[-1]
    mask = np.zeros(last.shape, "float32")
    mask.reshape(-1)[-1] = np.inf
    return list(grads[:-1]) + [last + tf.cast(mask, last.dtype)]


@pytest.mark.parametrize("traced", [True, False])
def test_mixed_float16_gradient_tape_one_skip_decision_for_every_rank(mixed_float16, traced):
    """An inf in rank 1's reduced slice only: rank 0's slices are finite, yet it skips too and halves alike."""
    x, y = data(steps=STEPS, seed=37)
    opt = hvd.DistributedOptimizer(loss_scaled("adam"), shard="parameters")
    model = opt.shard_model(zero3_model(SEED0 + RANK))
    ref_opt, ref = loss_scaled("adam"), zero3_model(SEED0)
    ref_opt.build(ref.trainable_variables)
    spoil = tf.Variable(True)  # the first step only, on rank 1 only (the reference: its one process)

    def step(xb, yb):
        edit = (lambda g: tf.cond(spoil, lambda: inf_in_last(g), lambda: list(g))) if RANK == 1 else None
        tape_step(opt, model, xb, yb, edit)

    def ref_step(xb, yb):
        tape_step(ref_opt, ref, xb, yb, lambda g: tf.cond(spoil, lambda: inf_in_last(g), lambda: list(g)))

    step, ref_step = (tf.function(step), tf.function(ref_step)) if traced else (step, ref_step)
    xs, ys = rank_rows(x), rank_rows(y)
    for k in range(STEPS):
        step(xs[k * PER_RANK:(k + 1) * PER_RANK], ys[k * PER_RANK:(k + 1) * PER_RANK])
        ref_step(x[k * PER_RANK * SIZE:(k + 1) * PER_RANK * SIZE], y[k * PER_RANK * SIZE:(k + 1) * PER_RANK * SIZE])
        scales = hvd.allgather(tf.reshape(opt.dynamic_scale, [1])).numpy().tolist()
        assert scales == [float(ref_opt.dynamic_scale)] * SIZE == [[512.0, 512.0, 1024.0][k]] * SIZE
        spoil.assign(False)
    assert int(opt.iterations) == int(ref_opt.iterations) == STEPS - 1
    flat = weights(model)
    assert_same_on_all_ranks(flat)
    np.testing.assert_allclose(flat, weights(ref), atol=MIXED_TOLERANCE)

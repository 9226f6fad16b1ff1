"""TensorFlow/Keras 3 data parallelism under a launcher: every rank ends equal to one-process training.

Each rank starts from its OWN random weights (seed 100 + rank); the reference is computed inside
every rank: one process training rank 0's initial model on the concatenation of all ranks' batches.
The sharded optimizer (ZeRO-1/2, ``DistributedOptimizer(shard=...)``) is checked here too, against
the same one-process reference (equal to plain data parallelism) to 1e-5.
# timeout: 600
"""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe
import dualframe.tensorflow.keras as hvd

# One process set per rank: a sharded optimizer over a set must use the set's size and rank, not the world's.
SINGLES = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
hvd.init(process_sets=SINGLES)
SIZE, RANK = hvd.size(), hvd.rank()
FEATURES, PER_RANK, STEPS = 6, 4, 6
SEED0 = 100


def data(steps=STEPS, per_rank=PER_RANK, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(steps * per_rank * SIZE, FEATURES).astype("float32")
    y = (np.tanh(x @ rng.randn(FEATURES, 1)) + 0.1 * rng.randn(len(x), 1)).astype("float32")
    return x, y


def rank_rows(array, per_rank=PER_RANK, rank=RANK):
    """This rank's rows: in global step k it takes the rank-th block of per_rank rows."""
    blocks = array.reshape(-1, SIZE, per_rank, *array.shape[1:])
    return blocks[:, rank].reshape(-1, *array.shape[1:])


def make_model(seed, norm=None, built=True, cls=keras.Sequential):
    """Seeded initializers: the same weights whenever the model gets built (now, or in fit)."""
    keras.utils.set_random_seed(seed)
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((FEATURES,))] if built else []
    layers += [keras.layers.Dense(16, activation="tanh", kernel_initializer=init(seed), bias_initializer="zeros")]
    layers += [norm()] if norm else []
    return cls(layers + [keras.layers.Dense(1, kernel_initializer=init(seed + 1))])


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def assert_equal_on_all_ranks(model):
    gathered = hvd.allgather(tf.constant(flat(model)[None])).numpy()
    for row in gathered[1:]:
        np.testing.assert_array_equal(row, gathered[0])


def reference(optimizer, x, y, batch, epochs=1, norm=None, initial=None):
    model = make_model(SEED0, norm)
    if initial is not None:
        model.set_weights(initial)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model


def distributed_fit(optimizer, x, y, epochs=1, norm=None, batch=PER_RANK, callbacks=None, built=True):
    model = make_model(SEED0 + RANK, norm, built)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(rank_rows(x), rank_rows(y), batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)] + (callbacks or []))
    return model


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
    state = dualframe.tensorflow.elastic.TensorFlowKerasState(model, optimizer, batch=10 + RANK)
    state.sync()
    values = [v.numpy() for v in model.variables + optimizer.variables]
    for mine, root in zip(values, hvd.broadcast_object(values, root_rank=0)):
        np.testing.assert_array_equal(mine, root)
    assert state.batch == 10


# --- Sharded optimizer (ZeRO-1/2): equal to plain data parallelism -------------------------------------------------
SHARDED_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.7), momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
}


def residual_model(seed):
    """A functional model with a residual connection (Add of two branches)."""
    keras.utils.set_random_seed(seed)
    init = keras.initializers.GlorotUniform
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="tanh", kernel_initializer=init(seed))(inputs)
    branch = keras.layers.Dense(16, kernel_initializer=init(seed + 1))(hidden)
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer=init(seed + 2))(
        keras.layers.Add()([hidden, branch])))


def sharded_fit(optimizer, x, y, run_eagerly=False, seed=SEED0 + RANK, callbacks=True):
    model = residual_model(seed)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if callbacks else [])
    return model


def plain_fit(optimizer, x, y, batch, seed=SEED0):
    model = residual_model(seed)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


def assert_same_state(sharded, plain, atol=1e-5):
    """The sharded optimizer's gathered state is the plain optimizer's, variable by variable."""
    arrays = sharded.state_arrays()
    assert len(arrays) == len(plain.variables)
    for array, variable in zip(arrays, plain.variables):
        np.testing.assert_allclose(array, np.asarray(variable), atol=atol, err_msg=variable.path)


@pytest.mark.parametrize("shard,name,run_eagerly,passes", [
    ("optimizer", "sgd", False, 1), ("gradients", "adam", True, 1), ("optimizer", "adamw", True, 1),
    ("gradients", "sgd", False, 1), ("optimizer", "adam", False, 2), ("gradients", "adam", False, 2)])
def test_sharded_fit_equals_plain_data_parallelism(shard, name, run_eagerly, passes):
    x, y = data(steps=passes * STEPS, seed=20)
    opt = hvd.DistributedOptimizer(SHARDED_OPTIMIZERS[name](), shard=shard, backward_passes_per_step=passes,
                                   average_aggregated_gradients=True)
    model = sharded_fit(opt, x, y, run_eagerly)
    ref = plain_fit(SHARDED_OPTIMIZERS[name](), x, y, passes * PER_RANK * SIZE)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-5)
    assert int(opt.iterations) == int(ref.optimizer.iterations) == STEPS  # schedules see the same step
    assert_same_state(opt, ref.optimizer)
    full = sum(int(np.prod(v.shape)) * 4 for v in ref.optimizer.variables if len(v.shape))
    assert opt.state_bytes() <= full // SIZE + 64  # this rank's slots: half of the plain optimizer's


@pytest.mark.parametrize("scatter", ["reducescatter", "allreduce"])
def test_sharded_scatter_paths_equal_plain_data_parallelism(scatter):
    """Both reduce-scatter paths: plain DP's numbers, also when Keras numbered the layers differently per rank.

    Horovod pairs the ranks' traced collectives by name, and by default takes it from the first input's
    name: a gradient's carries its layer's name, which Keras numbers per process. Rank 1 makes one more
    layer first, so its layers are named differently; the allreduce path then sent names rank 0 never
    sent, and the job aborted under Gloo (issue 17). Under Gloo and MPI both paths must pair up.
    """
    if RANK == 1:
        keras.layers.Dense(1)  # not a collective: only shifts this rank's automatic layer numbers by one
    x, y = data(seed=22)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard="gradients", scatter=scatter)
    model = sharded_fit(opt, x, y)
    ref = plain_fit(keras.optimizers.Adam(0.01), x, y, PER_RANK * SIZE)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-5)
    assert_same_state(opt, ref.optimizer)


def test_plain_fit_pairs_up_when_ranks_number_layers_differently():
    """Plain data parallelism names its traced allreduces by position too (before: by layer name, and hung)."""
    if RANK == 1:
        keras.layers.Dense(1)  # shifts this rank's automatic layer numbers by one more
    x, y = data(seed=23)
    model = sharded_fit(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), x, y)
    assert len(set(hvd.allgather_object(model.layers[1].name))) == SIZE  # the ranks' layer names do differ
    ref = plain_fit(keras.optimizers.Adam(0.01), x, y, PER_RANK * SIZE)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-5)


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_global_clipnorm_equals_plain_data_parallelism(shard):
    """The norm over all ranks' slices (an allreduce of their squared norms) clips as Keras clips the whole gradient."""
    x, y = data(seed=25)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01, global_clipnorm=0.05), shard=shard)
    model = sharded_fit(opt, x, y)
    ref = plain_fit(keras.optimizers.Adam(0.01, global_clipnorm=0.05), x, y, PER_RANK * SIZE)
    unclipped = plain_fit(keras.optimizers.Adam(0.01), x, y, PER_RANK * SIZE)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-5)
    assert np.abs(flat(ref) - flat(unclipped)).max() > 1e-4  # the clip acted
    assert_same_state(opt, ref.optimizer)


def test_sharded_fp16_compression_within_fp16_tolerance():
    x, y = data(seed=21)
    model = sharded_fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), shard="gradients",
                                                 compression=hvd.Compression.fp16), x, y)
    ref = plain_fit(keras.optimizers.SGD(0.1, momentum=0.5), x, y, PER_RANK * SIZE)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=3e-3)
    assert np.abs(flat(model) - flat(ref)).max() > 0  # the gradients really went through float16


def test_sharded_over_a_process_set_uses_the_sets_size_and_rank():
    # Each rank's set is itself alone: it trains on its own rows as one process would (rank 1 is rank 0 of its set).
    x, y = data(seed=22)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard="optimizer", process_set=SINGLES[RANK])
    model = sharded_fit(opt, x, y, callbacks=False)
    ref = plain_fit(keras.optimizers.Adam(0.01), rank_rows(x), rank_rows(y), PER_RANK, seed=SEED0 + RANK)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-5)
    assert_same_state(opt, ref.optimizer)


def attention_model(seed, tokens=5, width=8):
    """A small Transformer block: masked self-attention, residual, LayerNormalization, a feed-forward head."""
    keras.utils.set_random_seed(seed)
    inputs, mask = keras.Input((tokens, width)), keras.Input((tokens, tokens), dtype="bool")
    # No biases: the key bias has a gradient of exactly zero (it shifts a query's logits alike), so Adam
    # would amplify rounding noise in it (1e-9 / sqrt(1e-18)) into steps that differ with summation order.
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, use_bias=False, seed=seed)(
        inputs, inputs, attention_mask=mask)
    hidden = keras.layers.LayerNormalization()(keras.layers.Add()([inputs, attended]))
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(16, activation="relu")(hidden))
    return keras.Model([inputs, mask], keras.layers.Dense(1)(pooled))


@pytest.mark.parametrize("traced", [True, False])
def test_sharded_gradient_tape_transformer_block_equals_one_process(traced):
    rng = np.random.RandomState(23)
    n, tokens = STEPS * PER_RANK * SIZE, 5
    x = rng.randn(n, tokens, 8).astype("float32")
    lengths = rng.randint(2, tokens + 1, size=n)
    mask = np.arange(tokens)[None, None, :] < lengths[:, None, None]
    mask = np.broadcast_to(mask, (n, tokens, tokens)).copy()
    y = x[:, 0, :1] * 0.5

    def train(model, optimizer, xs, masks, ys, batch, distributed):
        def step(xb, mb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model([xb, mb], training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        step = tf.function(step) if traced else step
        if distributed:
            hvd.broadcast_variables(model.variables, root_rank=0)
        for k in range(STEPS):
            rows = slice(k * batch, (k + 1) * batch)
            step(xs[rows], masks[rows], ys[rows])

    model, opt = attention_model(SEED0 + RANK), hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard="gradients")
    train(model, opt, rank_rows(x), rank_rows(mask), rank_rows(y), PER_RANK, True)
    ref, ref_opt = attention_model(SEED0), keras.optimizers.Adam(0.01)
    train(ref, ref_opt, x, mask, y, PER_RANK * SIZE, False)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(ref), atol=1e-5)
    assert_same_state(opt, ref_opt)


def test_sharded_bad_input_refused_on_every_rank():
    sgd = lambda **kw: keras.optimizers.SGD(0.1, **kw)  # noqa: E731
    with pytest.raises(dualframe.StrategyError, match="unknown shard 'weights'"):
        hvd.DistributedOptimizer(sgd(), shard="weights")
    with pytest.raises(dualframe.StrategyError, match="op Average or Sum.*Adasum"):
        hvd.DistributedOptimizer(sgd(), shard="optimizer", op=hvd.Adasum)
    for optimizer, rule in ((keras.optimizers.Lamb(), "Lamb is not one of them"), (keras.optimizers.Adafactor(), "Adafactor"),
                            (sgd(clipnorm=1.0), "clipnorm=1.0")):
        with pytest.raises(dualframe.StrategyError, match=rule):
            hvd.DistributedOptimizer(optimizer, shard="gradients")
    with pytest.raises(dualframe.StrategyError, match="loss scaling"):
        hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(sgd()), shard="optimizer")
    # Ranks holding different parameters: the signatures are gathered, and every rank raises.
    model = make_model(SEED0) if RANK == 0 else keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(16), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(sgd(), shard="optimizer")
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.raises(dualframe.StrategyError, match="rank 1 differs from rank 0"):
        opt.apply(grads, model.trainable_variables)
    # Nothing else was sent: the next collective pairs up on every rank.
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == SIZE


def test_sharded_checkpoint_round_trip_plain_and_back(tmp_path_factory):
    import h5py
    import zipfile

    x, y = data(seed=24)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard="optimizer")
    model = sharded_fit(opt, x, y)
    paths = hvd.allgather_object(str(tmp_path_factory.mktemp(f"rank{RANK}") / "model.keras"))
    model.save(paths[RANK])  # every rank saves (the state is gathered); rank 0's file is the checkpoint
    hvd.barrier()
    # Into a plain optimizer: the file holds the unsharded layout.
    plain = residual_model(SEED0)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.optimizer.build(plain.trainable_variables)
    with zipfile.ZipFile(paths[0]) as archive, archive.open("model.weights.h5") as weights, \
            h5py.File(weights, "r") as h5:
        store = {key: np.asarray(value) for key, value in h5["optimizer"]["vars"].items()}
    plain.optimizer.load_own_variables(store)
    assert_same_state(opt, plain.optimizer, atol=0)
    # And back into a sharded one: the loaded model trains on exactly as the saved one.
    loaded = keras.models.load_model(paths[0])
    assert type(loaded.optimizer) is type(opt) and loaded.optimizer.shard == "optimizer"
    np.testing.assert_array_equal(flat(loaded), flat(model))
    for a, b in zip(loaded.optimizer.state_arrays(), opt.state_arrays()):
        np.testing.assert_array_equal(a, b)
    # dualframe's own checkpoint (every rank calls, rank 0 writes) holds the gathered state too.
    folder = hvd.allgather_object(str(tmp_path_factory.mktemp(f"ckpt{RANK}")))[0]
    hvd.save_checkpoint(folder, model, step=STEPS)
    fresh = residual_model(SEED0 + RANK)
    fresh.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard="optimizer"), loss="mse")
    assert hvd.load_checkpoint(folder, fresh).step == STEPS
    for a, b in zip(fresh.optimizer.state_arrays(), opt.state_arrays()):
        np.testing.assert_array_equal(a, b)
    for m in (model, loaded, fresh):
        m.fit(rank_rows(x)[:PER_RANK], rank_rows(y)[:PER_RANK], batch_size=PER_RANK, verbose=0, shuffle=False)
    np.testing.assert_allclose(flat(loaded), flat(model), atol=1e-6)
    np.testing.assert_allclose(flat(fresh), flat(model), atol=1e-6)


def test_sharded_elastic_state_restores_and_resyncs_the_full_state():
    x, y = data(seed=25)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard="gradients")
    model = sharded_fit(opt, x, y)
    state = dualframe.tensorflow.elastic.KerasState(model, batch=0)
    state.save()  # a commit: the full state is gathered on every rank
    before = opt.state_arrays()
    for variable in opt.shard_variables():  # a failed step left garbage in this rank's slices
        variable.assign(tf.fill(variable.shape, float(RANK + 7)))
    state.restore()
    for a, b in zip(opt.state_arrays(), before):
        np.testing.assert_array_equal(a, b)
    opt.reshard()  # as after a resize: new slices, empty state; sync re-cuts rank 0's saved state
    state.reset()  # drops the traced step, which holds the old slices
    state.sync()
    for a, b in zip(opt.state_arrays(), before):
        np.testing.assert_array_equal(a, b)
    model.fit(rank_rows(x)[:PER_RANK], rank_rows(y)[:PER_RANK], batch_size=PER_RANK, verbose=0, shuffle=False)
    assert_equal_on_all_ranks(model)

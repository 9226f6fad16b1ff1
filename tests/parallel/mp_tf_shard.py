"""The Keras sharded optimizer (ZeRO-1/2, ``DistributedOptimizer(shard=...)``) on 2 ranks: equal to plain data parallelism.

Every rank runs every test. Each compares with plain data parallelism's one-process reference (rank 0's
initial model trained on the concatenation of all ranks' batches, computed inside every rank) to 1e-5,
optimizer state included (fp16 compression: 3e-3). The torch twin: mp_torch_shard.py.
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

# One process set per rank: a sharded optimizer over a set must use the set's size and rank, not the world's.
SINGLES = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
hvd.init(process_sets=SINGLES)
SIZE, RANK = hvd.size(), hvd.rank()

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


def sharded_fit(optimizer, x, y, run_eagerly=False, broadcast=True):
    return rank_fit(residual_model(SEED0 + RANK), optimizer, x, y, broadcast=broadcast, run_eagerly=run_eagerly)


def plain_fit(optimizer, x, y, batch, seed=SEED0):
    return one_process_fit(residual_model(seed), optimizer, x, y, batch)


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
    model = sharded_fit(opt, x, y, broadcast=False)
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
    state = dualframe.tensorflow.reliability.elastic.KerasState(model, batch=0)
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

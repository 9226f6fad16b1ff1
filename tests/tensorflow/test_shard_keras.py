"""The Keras sharded optimizer (ZeRO-1/2) in one process: equal to the plain optimizer, refusals, config, state layout."""
import numpy as np
import pytest
import keras

import dualframe
import dualframe.tensorflow.keras as hvd
from dualframe.tensorflow.dp.shard.optimizer import ShardedOptimizer

hvd.init()


def model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    hidden = keras.layers.Add()([hidden, keras.layers.Dense(8)(hidden)])
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def trained(optimizer, batch=6, run_eagerly=False):
    rng = np.random.RandomState(0)
    x = rng.randn(24, 5).astype("float32")
    m = model()
    m.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    m.fit(x, np.tanh(x.sum(1, keepdims=True)), batch_size=batch, shuffle=False, verbose=0)
    return m


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_many_buckets_equal_plain_adam_and_state_in_plain_layout(shard):
    # bucket_elements=20: tensors spread over several buckets, one larger than the cap on its own.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), shard=shard, bucket_elements=20)
    sharded, plain = trained(opt), trained(keras.optimizers.Adam(0.05))
    assert len(opt._zero.layout.buckets) > 2
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    arrays = opt.state_arrays()
    assert [a.shape for a in arrays] == [tuple(v.shape) for v in plain.optimizer.variables]
    for a, v in zip(arrays, plain.optimizer.variables):
        np.testing.assert_allclose(a, np.asarray(v), atol=1e-6, err_msg=v.path)
    assert opt.state_bytes() == sum(a.nbytes for a in arrays if a.ndim)  # one rank: the whole state
    assert not {id(v) for v in opt.shard_variables()} & {id(v) for v in opt.variables}


def test_config_round_trip_and_wrapped_once():
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), shard="gradients",
                                   backward_passes_per_step=2, bucket_elements=64)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(again, ShardedOptimizer)
    assert (again.shard, again.bucket_elements, again.accumulation.steps) == ("gradients", 64, 2)
    assert float(again.learning_rate) == pytest.approx(0.1)
    with pytest.raises(dualframe.StrategyError, match="already distributed"):
        hvd.DistributedOptimizer(opt, shard="optimizer")
    plain = hvd.DistributedOptimizer(keras.optimizers.SGD(), shard=None)  # the plain wrapper (an SGD too, as Horovod's)
    assert isinstance(plain, hvd.DistributedOptimizer) and isinstance(plain, keras.optimizers.SGD)


@pytest.mark.parametrize("make, rule", [
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="weights"), "unknown shard 'weights'"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="optimizer", op=hvd.Adasum), "Adasum"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="optimizer", op=hvd.Max), "op Average or Sum"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.Muon(), shard="optimizer"), "Muon is not one of them"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.Adam(use_ema=True), shard="optimizer"), "use_ema"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="optimizer", bucket_elements=0), "bucket_elements"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), scatter="allreduce"), r"needs shard='optimizer'"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="optimizer", scatter="ring"),
     "unknown scatter 'ring'; choose one of auto, reducescatter, allreduce"),
])
def test_refused_before_anything(make, rule):
    with pytest.raises(dualframe.StrategyError, match=rule):
        make()


def test_exclude_from_weight_decay_refused():
    adamw = keras.optimizers.AdamW(weight_decay=0.1)
    adamw.exclude_from_weight_decay(var_names=["bias"])
    with pytest.raises(dualframe.StrategyError, match="exclude_from_weight_decay"):
        hvd.DistributedOptimizer(adamw, shard="optimizer")


def test_state_of_another_optimizer_refused_and_reshard_keeps_the_layout():
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), shard="optimizer")
    m = trained(opt)
    with pytest.raises(dualframe.StrategyError, match="does not match this sharded Adam"):
        opt.load_state_arrays(opt.state_arrays()[:-1])
    before = opt.state_arrays()
    opt.reshard()  # a new layout for the same size: empty slots until the state is loaded
    opt.load_state_arrays(before)
    for a, b in zip(opt.state_arrays(), before):
        np.testing.assert_array_equal(a, b)
    m.train_function = None  # the traced step held the old slices
    m.fit(np.ones((6, 5), "float32"), np.ones((6, 1), "float32"), verbose=0)
    assert int(opt.iterations) == 5


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_global_clipnorm_equals_plain_and_survives_the_config(shard):
    # A clip norm small enough that every step is clipped: the norm must cover every bucket, not one.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05, global_clipnorm=0.05), shard=shard, bucket_elements=20)
    sharded, plain = trained(opt), trained(keras.optimizers.Adam(0.05, global_clipnorm=0.05))
    unclipped = trained(keras.optimizers.Adam(0.05))
    assert opt._zero.inner.global_clipnorm is None  # the copy sees one rank's slices: it must not clip them
    for a, b, c in zip(sharded.get_weights(), plain.get_weights(), unclipped.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert max(np.abs(b - c).max() for b, c in zip(plain.get_weights(), unclipped.get_weights())) > 1e-4
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert again.global_clipnorm_value == pytest.approx(0.05) and again._zero.inner.global_clipnorm is None
    with pytest.raises(dualframe.StrategyError, match="clipnorm=1.0"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(clipnorm=1.0), shard="optimizer")


def test_loss_scale_optimizer_with_shard_keeps_its_settings_and_round_trips_its_config():
    from dualframe.tensorflow.dp.shard.precision import ShardedLossScaleOptimizer

    given = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05), initial_scale=64.0,
                                                dynamic_growth_steps=3)
    opt = hvd.DistributedOptimizer(given, shard="gradients", bucket_elements=20)
    assert type(opt) is ShardedLossScaleOptimizer and isinstance(opt.inner_optimizer, ShardedOptimizer)
    assert (opt.initial_scale, opt.dynamic_growth_steps, opt.inner_optimizer.shard) == (64.0, 3, "gradients")
    again = ShardedLossScaleOptimizer.from_config(opt.get_config())
    assert (again.initial_scale, again.inner_optimizer.bucket_elements) == (64.0, 20)
    sharded, plain = trained(opt), trained(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.05), initial_scale=64.0, dynamic_growth_steps=3))
    assert float(opt.dynamic_scale) == float(plain.optimizer.dynamic_scale) == 128.0  # 4 steps: grown once
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(dualframe.StrategyError, match="already distributed"):
        hvd.DistributedOptimizer(opt, shard="optimizer")


def test_low_precision_variables_refused_by_name():
    keras.mixed_precision.set_dtype_policy("bfloat16")
    try:
        m = model()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="optimizer")
        with pytest.raises(dualframe.StrategyError, match="dense.*/kernel \\(bfloat16\\).*mixed_bfloat16 policy"):
            opt.build(m.trainable_variables)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")

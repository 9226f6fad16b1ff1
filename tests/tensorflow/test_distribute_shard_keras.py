"""distribute(model, DataParallel(shard=...)) in one process: the strategy reaches the Keras sharded optimizer, same weights."""
import numpy as np
import pytest
import keras

import dualframe
import dualframe.tensorflow.keras as hvd
from dualframe.tensorflow.dp.shard.optimizer import ShardedOptimizer

hvd.init()


def fitted(shard):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    m = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    m.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    m = hvd.distribute(m, dualframe.DataParallel(shard=shard))
    x = np.random.RandomState(0).randn(24, 5).astype("float32")
    m.fit(x, np.tanh(x.sum(1, keepdims=True)), batch_size=6, shuffle=False, verbose=0)
    return m


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_distribute_with_shard_equals_distribute_without(shard):
    sharded, plain = fitted(shard), fitted("none")
    assert isinstance(sharded.optimizer, ShardedOptimizer) and sharded.optimizer.shard == shard
    assert not isinstance(plain.optimizer, ShardedOptimizer)
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_distribute_unsharded_keeps_the_loss_scaling_wrapper():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        m = hvd.distribute(m, dualframe.DataParallel())
        assert isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer)
    finally:
        keras.mixed_precision.set_global_policy("float32")

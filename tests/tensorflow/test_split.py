"""dualframe.tensorflow.ModelParallel: variables on the declared devices, same numbers as the unsplit model."""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.errors import BalanceError, ChunksError, DeviceError, StrategyError


def layers(seed=0):
    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(12, activation="relu"),
            keras.layers.Dense(12, activation="gelu"), keras.layers.Dense(3)]


def reference_of(split, input_dim=6):
    """An unsplit keras.Sequential of the same layers' copies, weights taken from ``split.get_weights()``."""
    model = keras.Sequential([keras.Input((input_dim,))] + layers(seed=99))
    model.set_weights(split.get_weights())
    return model


def grads(model, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = model(x, training=True)
        loss = tf.reduce_mean(out ** 2)
    g = tape.gradient(loss, [x] + model.trainable_variables)
    return out, g


def assert_same(a, b, atol=1e-5):
    (out, g), (ref_out, ref_g) = a, b
    np.testing.assert_allclose(out.numpy(), ref_out.numpy(), atol=atol, rtol=0)
    assert len(g) == len(ref_g)
    for x, y in zip(g, ref_g):
        np.testing.assert_allclose(x.numpy(), y.numpy(), atol=atol, rtol=0)


@pytest.mark.parametrize("balance, devices", [([2, 2], ["/CPU:1", "/CPU:2"]), ([1, 3], ["/CPU:3", "/CPU:0"]),
                                              ([1, 1, 2], ["/CPU:1", "/CPU:2", "/CPU:3"])])
def test_variables_on_their_devices_and_numbers_equal_the_unsplit_model(balance, devices):
    split = hvd.ModelParallel(layers(), balance, devices)
    x = tf.random.normal((7, 6), seed=1)
    split(x)
    for j, (group, device) in enumerate(zip(split.plan.ranges, devices)):
        for index in group:
            for v in split.split_layers[index].weights:
                assert v.value.device.endswith(device.replace("/", "device:")), (j, v.path, v.value.device)
    reference = reference_of(split)
    assert [w.shape for w in split.get_weights()] == [w.shape for w in reference.get_weights()]
    assert_same(grads(split, x), grads(reference, x))


def test_fit_equals_the_unsplit_model():
    split = hvd.ModelParallel(layers(), [2, 2], ["/CPU:1", "/CPU:2"])
    split.build((None, 6))
    reference = reference_of(split)
    rng = np.random.RandomState(0)
    x, y = rng.randn(20, 6).astype("float32"), rng.randn(20, 3).astype("float32")
    for model in (split, reference):
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(split.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert split.get_weights()[0].shape == (6, 12)  # layer order


def test_stage_devices_keeps_what_was_asked_and_stands_logical_cpus_in_for_missing_gpus():
    assert hvd.stage_devices("/CPU:0, cpu:1") == ["/CPU:0", "/CPU:1"]
    assert hvd.stage_devices(["/CPU:2", "/CPU:3"]) == ["/CPU:2", "/CPU:3"]
    assert hvd.stage_devices(None, 3) == ["/CPU:0", "/CPU:1", "/CPU:2"]  # no GPU here; 4 logical CPUs exist
    with pytest.raises(DeviceError, match="unknown device 'gpu-one'"):
        hvd.stage_devices("/CPU:0,gpu-one")
    with pytest.raises(DeviceError, match="TensorFlow is already initialized"):
        hvd.stage_devices("/CPU:7")  # more CPU devices than exist, once TensorFlow runs


def test_devices_omitted_fall_back_to_cpu():
    assert hvd.ModelParallel(layers(), [2, 2]).devices == ("/CPU:0", "/CPU:0")


@pytest.mark.parametrize("balance, devices, kwargs, error, message", [
    ([2, 1], ["/CPU:0", "/CPU:1"], {}, BalanceError, r"balance: \[2, 1\] = 2 \+ 1 = 3, layers: 4"),
    ([4, 0], ["/CPU:0", "/CPU:1"], {}, BalanceError, r"balance\[1\] = 0"),
    ([5, -1], ["/CPU:0", "/CPU:1"], {}, BalanceError, r"balance\[1\] = -1"),
    ([2, 2], ["/CPU:0"], {}, DeviceError, r"len\(devices\) = 1, len\(balance\) = 2"),
    ([2, 2], ["/CPU:0", "/XPU:1"], {}, DeviceError, r"unknown device '/XPU:1'"),
    ([2, 2], ["/CPU:0", "/GPU:0"], {}, DeviceError,
     r"'/GPU:0' \(devices\[1\]\) is not available here; available: /CPU:0, /CPU:1, /CPU:2, /CPU:3; more CPU devices"),
    ([2, 2], ["/CPU:0", "/CPU:1"], {"chunks": 0}, ChunksError, r"chunks must be an int >= 1 \(chunks: 0\)"),
    ([2, 2], ["/CPU:0", "/CPU:1"], {"checkpoint": "often"}, StrategyError, r"unknown checkpoint 'often'"),
])
def test_bad_input_refused_before_any_variable(balance, devices, kwargs, error, message):
    parts = layers()
    with pytest.raises(error, match=message):
        hvd.Pipeline(parts, balance, devices, **kwargs)
    assert not any(layer.built for layer in parts)


def test_small_batch_refused_with_advice():
    pipe = hvd.Pipeline(layers(), [2, 2], ["/CPU:1", "/CPU:2"], chunks=4)
    with pytest.raises(ChunksError, match=r"batch is smaller than chunks \(batch: 3, chunks: 4\); use chunks <= 3"):
        pipe(tf.zeros((3, 6)))


def test_balance_helpers():
    parts = [keras.layers.Dense(100), keras.layers.Dense(10), keras.layers.Dense(10), keras.layers.Dense(10)]
    with pytest.raises(ValueError, match=r"layers must be built .*layers\[0\]"):
        hvd.balance_by_size(parts, 2)
    keras.Sequential([keras.Input((100,))] + parts)
    assert hvd.balance_by_size(parts, 2) == [1, 3]
    # The last layer's ~3 GFLOP (forward + backward) outweighs the others by far more than a loaded box's
    # scheduling delays, which flipped a 512-wide version to [3, 3] under load 5.
    wide = [keras.layers.Dense(8) for _ in range(4)] + [keras.layers.Dense(1024), keras.layers.Dense(1024)]
    balance = hvd.balance_by_time(wide, tf.random.normal((512, 8)), 2)
    assert sum(balance) == 6 and balance[1] <= 2, balance

"""Keras checkpoints in one process: round trip with optimizer, Dropout seed and RNG, safe loads, keep-last-k, bad input."""
import os
import pickle
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow.keras as hvd
from dualframe.reliability.checkpoint import CheckpointError
from dualframe.tensorflow.reliability import checkpoint as keras_checkpoint

hvd.init()


def model_with_optimizer(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    return model


def fit_once(model, seed=3):
    x = np.random.RandomState(seed).randn(8, 3).astype("float32")
    model.fit(x, x[:, :2], batch_size=4, epochs=1, shuffle=False, verbose=0)


def test_round_trip_restores_weights_optimizer_progress_dropout_and_rng(tmp_path):
    model = model_with_optimizer(0)
    fit_once(model)
    np.random.seed(7); random.seed(7)
    hvd.save_checkpoint(str(tmp_path), model, step=2, epoch=1, data_position={"batch": 4}, extra={"lr": 0.01})
    draws = (np.random.rand(3), random.random())
    fit_once(model, seed=4)
    expected = model.get_weights()

    other = model_with_optimizer(1)
    np.random.seed(99); random.seed(99)
    state = hvd.load_checkpoint(str(tmp_path), other)
    assert (state.step, state.epoch, state.data_position, state.extra) == (2, 1, {"batch": 4}, {"lr": 0.01})
    assert np.array_equal(np.random.rand(3), draws[0]) and random.random() == draws[1]
    assert int(other.optimizer.iterations.numpy()) == 2
    fit_once(other, seed=4)  # Adam's moments, the iteration count and Dropout's seed all matter here
    for got, want in zip(other.get_weights(), expected):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_callback_saves_each_epoch_and_keeps_the_last_k(tmp_path):
    model = model_with_optimizer(0)
    assert hvd.load_checkpoint(str(tmp_path), model) is None
    x = np.random.RandomState(0).randn(8, 3).astype("float32")
    model.fit(x, x[:, :2], batch_size=4, epochs=3, verbose=0, callbacks=[hvd.CheckpointCallback(str(tmp_path), keep=2)])
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".npz")) == [
        "checkpoint-00000004.npz", "checkpoint-00000006.npz"]
    state = hvd.load_checkpoint(str(tmp_path), model_with_optimizer(1))
    assert (state.step, state.epoch, state.data_position) == (6, 3, {"epoch": 3, "batch": 0})


def test_callback_every_n_batches_records_the_data_position(tmp_path):
    model = model_with_optimizer(0)
    x = np.random.RandomState(0).randn(12, 3).astype("float32")
    model.fit(x, x[:, :2], batch_size=4, epochs=1, verbose=0,
              callbacks=[hvd.CheckpointCallback(str(tmp_path), save_freq=2)])
    state = hvd.load_checkpoint(str(tmp_path), model)
    assert (state.step, state.epoch, state.data_position) == (2, 0, {"epoch": 0, "batch": 2})


def test_a_pickled_object_is_never_unpickled(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.npz"
    np.savez(path, format=np.array("dualframe-keras-checkpoint/1"), header=np.array([Evil()], dtype=object))
    with pytest.raises(CheckpointError, match="not a loadable dualframe Keras checkpoint"):
        hvd.load_checkpoint(str(path), model_with_optimizer(0))
    path.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="not a loadable dualframe Keras checkpoint"):
        hvd.load_checkpoint(str(path), model_with_optimizer(0))
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_of_another_model_is_refused_before_any_assignment(tmp_path):
    hvd.save_checkpoint(str(tmp_path), model_with_optimizer(0), step=0)
    keras.utils.set_random_seed(0)
    wider = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5), keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    before = wider.get_weights()
    with pytest.raises(CheckpointError, match=r"has shape \(3, 5\), the checkpoint's .* has \(3, 4\)"):
        hvd.load_checkpoint(str(tmp_path), wider)
    for got, want in zip(wider.get_weights(), before):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kwargs, message", [
    ({"step": -1}, r"step must be an int >= 0 \(step: -1\)"),
    ({"step": 1, "keep": 0}, r"keep must be an int >= 1 \(keep: 0\)"),
    ({"step": 1, "data_position": {"x": object()}}, r"data_position must hold only JSON values"),
    ({"step": 1, "root_rank": 1}, r"root_rank must be a rank in \[0, 1\) \(root_rank: 1\)"),
])
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        hvd.save_checkpoint(str(tmp_path / "ckpt"), model_with_optimizer(0), **kwargs)
    assert not (tmp_path / "ckpt").exists()


def test_unbuilt_model_and_bad_callback_settings_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="is not built"):
        hvd.save_checkpoint(str(tmp_path), keras.Sequential([keras.layers.Dense(1)]), step=0)
    with pytest.raises(CheckpointError, match=r"save_freq must be 'epoch' or an int >= 1 \(save_freq: 0\)"):
        hvd.CheckpointCallback(str(tmp_path), save_freq=0)
    with pytest.raises(CheckpointError, match=r"keep must be an int >= 1 \(keep: 0\)"):
        hvd.CheckpointCallback(str(tmp_path), keep=0)


def epoch_data(epoch_draws):
    """One epoch of a data pipeline drawing from numpy, Python and TensorFlow's global generator."""
    noise = tf.random.get_global_generator().normal([6, 3])
    x = np.random.randn(6, 3).astype("float32") + noise.numpy() * random.random()
    epoch_draws.append(x)
    return x


def train_epochs(model, first, last, draws, callbacks=()):
    for epoch in range(first, last):
        x = epoch_data(draws)
        model.fit(x, x[:, :2], batch_size=2, epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0,
                  callbacks=list(callbacks))


def seed_everything(seed):
    keras.utils.set_random_seed(seed)
    tf.random.get_global_generator().reset_from_seed(seed)


def test_exact_resume_with_dropout_and_tensorflow_numpy_python_draws(tmp_path):
    """12 steps straight == 6 steps + save + fresh model and RNG streams + load + 6 steps, bit for bit."""
    seed_everything(5)
    straight, straight_draws = model_with_optimizer(0), []
    assert any("seed_generator" in v.path for v in straight.variables)  # Dropout's RNG is a model variable
    train_epochs(straight, 0, 4, straight_draws)

    seed_everything(5)
    first, draws = model_with_optimizer(0), []
    train_epochs(first, 0, 2, draws, [hvd.CheckpointCallback(str(tmp_path))])
    seed_everything(77)  # other weights, other streams: the load must bring everything back
    resumed = model_with_optimizer(1)
    state = hvd.load_checkpoint(str(tmp_path), resumed)
    assert (state.epoch, state.step) == (2, 6)
    train_epochs(resumed, state.epoch, 4, draws)
    for got, want in zip(draws, straight_draws):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_rng_state_round_trip_and_checkpoints_without_a_tensorflow_state():
    state = keras_checkpoint.rng_state()
    assert set(state) == {"numpy", "python", "tensorflow"}
    expected = (tf.random.get_global_generator().normal([2]).numpy(), np.random.rand(2))
    keras_checkpoint.set_rng_state(state)
    np.testing.assert_array_equal(tf.random.get_global_generator().normal([2]).numpy(), expected[0])
    del state["tensorflow"]  # a checkpoint written before TensorFlow's generator was saved
    keras_checkpoint.set_rng_state(state)
    np.testing.assert_array_equal(np.random.rand(2), expected[1])

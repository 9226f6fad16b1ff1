"""Keras checkpoints in one process: round trip with optimizer, Dropout seed and RNG, safe loads, keep-last-k, bad input."""
import os
import pickle
import random

import keras
import numpy as np
import pytest

import dualframe.tensorflow.keras as hvd
from dualframe.checkpoint import CheckpointError

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

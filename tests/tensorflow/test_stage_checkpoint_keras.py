"""Keras pipeline stage checkpoints in one process (a one-stage DistributedPipeline): round trip, merge, bad input."""
import os

import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
from dualframe.reliability.checkpoint import CheckpointError
from dualframe.tensorflow.keras import load_checkpoint


def build():
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, kernel_initializer=init(1)),
                             keras.layers.Dropout(0.2, seed=3), keras.layers.Dense(1, kernel_initializer=init(2))])


@pytest.fixture(scope="module")
def pipe():
    hvd.init()
    return hvd.DistributedPipeline(build(), [3], chunks=2, loss_fn="mse")


def values(variables):
    return [np.array(v.numpy()) for v in variables]


def test_round_trip_and_merge_into_the_plain_model(pipe, tmp_path):
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    pipe.train_step(np.ones((4, 3), "float32"), np.ones((4, 1), "float32"))
    pipe.apply_gradients(optimizer)
    model_vars = [v for layer in pipe.layers for v in layer.variables]  # Dropout's seed state included
    saved, saved_opt = values(model_vars), values(optimizer.variables)
    hvd.save_stage_checkpoint(str(tmp_path), pipe, optimizer, step=3, data_position={"next_step": 4})
    assert os.listdir(tmp_path) == ["stage-0"]
    for variable in model_vars + list(optimizer.variables):
        variable.assign(np.zeros(variable.shape, variable.dtype))
    state = hvd.load_stage_checkpoint(str(tmp_path), pipe, optimizer)
    assert (state.step, state.data_position) == (3, {"next_step": 4})
    for got, want in zip(values(model_vars) + values(optimizer.variables), saved + saved_opt):
        np.testing.assert_array_equal(got, want)
    plain = build()
    load_checkpoint(hvd.merge_stage_checkpoints(str(tmp_path), str(tmp_path / "full.npz")), plain, restore_rng=False)
    for got, want in zip(values(plain.variables), saved):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad, kwargs, message", [
    ({"pipe": "m"}, {"step": 1}, r"pipe must be a dualframe.tensorflow.DistributedPipeline \(pipe: str\)"),
    ({"optimizer": 5}, {"step": 1}, r"optimizer must be a keras.optimizers.Optimizer or None \(optimizer: int\)"),
    ({}, {"step": -1}, r"step must be an int >= 0 \(step: -1\)"),
    ({}, {"step": 1, "keep": 0}, r"keep must be an int >= 1 \(keep: 0\)"),
    ({}, {"step": 1, "data_position": object()}, r"data_position must hold only JSON values"),
])
def test_bad_arguments_are_refused_before_writing(pipe, tmp_path, bad, kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        hvd.save_stage_checkpoint(str(tmp_path / "c"), bad.get("pipe", pipe), bad.get("optimizer"), **kwargs)
    assert not (tmp_path / "c").exists()

"""dualframe.tensorflow.reliability.elastic in one process: Horovod's hvd.elastic names for GradientTape scripts on Keras 3."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from horovod.tensorflow.elastic import TensorFlowState as HorovodTensorFlowState

import dualframe.tensorflow as hvd
import dualframe.tensorflow.keras as hvd_keras
from dualframe.errors import StrategyError

hvd.init()


def tape_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.1)
    x = np.random.RandomState(0).randn(8, 3).astype("float32")

    def step(rows):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x[rows]) - 1.0) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model, optimizer, step


def test_names_are_horovods():
    assert hvd.elastic.run is hvd_keras.elastic.run
    assert hvd.elastic.TensorFlowState is HorovodTensorFlowState
    with pytest.raises(StrategyError, match=r"optimizer must be a keras.optimizers.Optimizer \(optimizer: str\)"):
        hvd.elastic.TensorFlowKerasState(tape_model()[0], "adam")


def test_tensorflow_keras_state_restores_model_and_explicit_optimizer_to_the_last_commit():
    model, optimizer, step = tape_model()
    step(slice(0, 4))  # builds the optimizer, as Horovod's example does before making the state
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    step(slice(4, 8))
    state.batch = 1
    state.commit()
    committed = [np.array(v.numpy()) for v in model.variables + optimizer.variables]
    assert int(optimizer.iterations.numpy()) == 2
    step(slice(0, 4))
    state.batch = 2
    state.restore()
    assert state.batch == 1 and int(optimizer.iterations.numpy()) == 2
    for variable, value in zip(model.variables + optimizer.variables, committed):
        np.testing.assert_array_equal(variable.numpy(), value)

"""hvd.elastic for Keras fit (dualframe.tensorflow.reliability.elastic), one process: checks, KerasState commit/restore, callbacks."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow.keras as hvd
from dualframe.errors import StrategyError

hvd.init()


def compiled():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    return model


def test_bad_arguments_are_refused():
    with pytest.raises(StrategyError, match="is not built"):
        hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(1)]))
    with pytest.raises(StrategyError, match=r"model must be a keras.Model \(model: str\)"):
        hvd.elastic.KerasState("model")
    state = hvd.elastic.KerasState(compiled(), epoch=0, batch=0)
    with pytest.raises(StrategyError, match=r"batches_per_commit must be an int >= 1 \(batches_per_commit: 0\)"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)
    with pytest.raises(StrategyError, match="run decorates a training function"):
        hvd.elastic.run(None)


def test_callbacks_track_progress_and_restore_goes_back_to_the_last_commit():
    model = compiled()
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    x = np.random.RandomState(0).randn(12, 3).astype("float32")
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]
    model.fit(x[:8], x[:8, :2], batch_size=4, epochs=1, verbose=0, callbacks=callbacks)  # 2 batches: committed
    committed = [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]
    assert (state.epoch, state.batch) == (1, 0)
    model.fit(x[8:], x[8:, :2], batch_size=4, initial_epoch=1, epochs=2, verbose=0,
              callbacks=callbacks[:2])  # 1 batch, not committed
    assert (state.epoch, state.batch) == (2, 0) and int(model.optimizer.iterations.numpy()) == 3
    state.restore()
    assert (state.epoch, state.batch) == (1, 0)
    for variable, value in zip(model.variables + model.optimizer.variables, committed):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_horovods_signature_the_positional_optimizer_is_the_states():
    """KerasState(model, optimizer, **kwargs) as Horovod's: the optimizer given is committed and restored."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])  # a custom loop's: not compiled
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    x = np.random.RandomState(0).randn(8, 3).astype("float32")

    def step():
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((model(x) - x[:, :2]) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    with pytest.raises(StrategyError, match=r"optimizer must be a keras.optimizers.Optimizer \(optimizer: str\)"):
        hvd.elastic.KerasState(model, "sgd")
    state = hvd.elastic.KerasState(model, optimizer, batch=0)  # builds the optimizer: its state is committed too
    assert state.optimizer is optimizer and optimizer.built and hvd.elastic.KerasState(compiled()).optimizer is not None
    step()
    state.batch = 1
    state.commit()
    committed = [np.array(v.numpy()) for v in model.variables + optimizer.variables]
    step()
    step()
    state.batch = 3
    state.restore()
    assert state.batch == 1 and int(optimizer.iterations.numpy()) == 1
    for variable, value in zip(model.variables + optimizer.variables, committed):  # momentum included
        np.testing.assert_array_equal(variable.numpy(), value)
    state.sync()  # one process: keeps the state as it is
    assert int(optimizer.iterations.numpy()) == 1

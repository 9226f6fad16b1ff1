"""dualframe.tensorflow.keras.elastic in one process: argument checks, KerasState commit/restore, progress callbacks."""
import keras
import numpy as np
import pytest

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

"""The TensorFlow stall bound in one process: Keras train steps guarded once, disarmed after success and failure."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow.keras as hvd
from dualframe.reliability import failure
from dualframe.reliability.failure import Watchdog
from dualframe.tensorflow.reliability.failure import GuardedStep, eager_guard, guard_train_function

hvd.init()


@pytest.fixture
def watchdog(monkeypatch):
    """A live watchdog, as under a launcher (one process alone gets a disabled one)."""
    live = Watchdog(timeout=60)
    monkeypatch.setitem(failure._installed, "watchdog", live)
    return live


def small_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    return model


def test_fit_with_the_callbacks_guards_each_step_once_and_leaves_nothing_armed(watchdog, tmp_path):
    model, seen = small_model(), []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dict(watchdog.active()))

    x = np.ones((8, 3), dtype="float32")
    for callback in (hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.StallGuardCallback(),
                     hvd.CheckpointCallback(str(tmp_path), save_freq=1000)):
        model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[callback, Spy()])
        assert isinstance(model.train_function, GuardedStep)
        assert not isinstance(model.train_function.step, GuardedStep)  # wrapped once, however many fits
    assert seen and all(active == {} for active in seen)


def test_a_failing_step_disarms_so_a_caller_that_recovers_is_not_ended_later(watchdog):
    def step(_):
        assert watchdog.active(), "the step runs armed"
        raise RuntimeError("peer lost")

    with pytest.raises(RuntimeError, match="peer lost"):
        GuardedStep(step, watchdog)(None)
    assert watchdog.active() == {}
    with pytest.raises(TypeError, match="already guarded"):
        GuardedStep(GuardedStep(step, watchdog), watchdog)


def test_one_process_adds_nothing_and_eager_guards_arm_only_eagerly(watchdog):
    with eager_guard("allreduce x"):
        assert list(watchdog.active().values())[0][1] == "a Horovod collective (allreduce x)"
    armed = []

    @tf.function
    def traced():
        with eager_guard("allreduce in a graph"):  # tracing waits on nobody: nothing to bound
            armed.append(bool(watchdog.active()))
        return tf.constant(0)

    traced()
    assert armed == [False]
    with hvd.stall_guard("a custom step"):
        assert list(watchdog.active().values())[0][1] == "a custom step"
    assert watchdog.active() == {}
    failure._installed["watchdog"] = Watchdog(0)
    model = small_model()
    assert guard_train_function(model) is False and not isinstance(model.train_function, GuardedStep)
    with pytest.raises(TypeError, match="non-empty string"):
        hvd.stall_guard("")

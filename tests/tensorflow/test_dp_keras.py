"""dualframe.tensorflow.keras in one process: the optimizer wrapper, saving, callbacks, checks (size 1)."""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe
import dualframe.keras as hvd_alias
import dualframe.tensorflow.keras as hvd

hvd.init()


def model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


def xy(rows=24, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, 5).astype("float32")
    return x, np.tanh(x.sum(1, keepdims=True)).astype("float32")


def trained(optimizer, batch, epochs=1, run_eagerly=False, seed=0):
    m = model(seed)
    m.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    m.fit(*xy(), batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return m


def assert_same_weights(a, b, atol=1e-6):
    for p, q in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(p, q, atol=atol)


def test_alias_module_is_the_same():
    assert hvd_alias is hvd


def test_one_process_fit_equals_plain_keras():
    plain = trained(keras.optimizers.Adam(0.01), batch=6, epochs=2)
    wrapped = trained(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), batch=6, epochs=2)
    assert_same_weights(plain, wrapped)
    assert int(wrapped.optimizer.iterations) == 8


def test_backward_passes_per_step_sums_or_averages_two_half_batches():
    averaged = trained(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                                average_aggregated_gradients=True), batch=3)
    assert_same_weights(averaged, trained(keras.optimizers.SGD(0.1), batch=6))
    summed = trained(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2), batch=3,
                     run_eagerly=True)
    assert_same_weights(summed, trained(keras.optimizers.SGD(0.1), batch=6, run_eagerly=True))
    assert int(summed.optimizer.iterations) == 4


def test_learning_rate_is_the_inner_optimizers():
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    opt.learning_rate = 0.25
    assert float(opt.inner_optimizer.learning_rate) == pytest.approx(0.25)
    assert float(opt.learning_rate) == pytest.approx(0.25)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_keras_two_lr_name_reads_and_sets_the_inner_rate(policy):
    # Horovod's examples call tf.keras.backend.set_value(model.optimizer.lr, rate) and read .lr.numpy().
    keras.mixed_precision.set_global_policy(policy)
    try:
        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.1))
        assert float(opt.lr.numpy()) == pytest.approx(0.1)
        tf.keras.backend.set_value(opt.lr, 0.5)
        assert float(opt.inner_optimizer.learning_rate) == pytest.approx(0.5)
        opt.lr = 0.25
        assert float(opt.inner_optimizer.learning_rate) == pytest.approx(0.25)
        assert float(opt.learning_rate) == pytest.approx(0.25)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_save_and_load_model_keeps_distributed_optimizer_and_its_state(tmp_path):
    m = trained(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), compression=hvd.Compression.fp16,
                                         backward_passes_per_step=2), batch=3)
    m.save(tmp_path / "m.keras")
    loaded = hvd.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer)
    assert loaded.optimizer.reduction.compression is hvd.Compression.fp16
    assert loaded.optimizer.accumulation.steps == 2
    for saved, restored in zip(m.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(restored))
    assert_same_weights(m, loaded, atol=0)


def test_load_model_wraps_a_plain_optimizer_and_training_continues_the_same(tmp_path):
    plain = trained(keras.optimizers.Adam(0.01), batch=6)
    plain.save(tmp_path / "plain.keras")
    loaded = hvd.load_model(tmp_path / "plain.keras")
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer)
    again = keras.models.load_model(tmp_path / "plain.keras")
    for m in (loaded, again):
        m.fit(*xy(seed=1), batch_size=6, shuffle=False, verbose=0)
    assert_same_weights(loaded, again)


def test_loss_scale_optimizer_becomes_distributed_loss_scale_optimizer():
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0),
                                   compression="fp16")
    assert isinstance(opt, hvd.DistributedLossScaleOptimizer)
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer) and opt.initial_scale == 64.0
    m = model()
    m.compile(optimizer=opt, loss="mse")
    assert m.optimizer is opt  # compile does not wrap it again
    m.fit(*xy(), batch_size=6, verbose=0)
    assert float(opt.dynamic_scale) == 64.0
    config = opt.get_config()
    assert config["compression"] == "fp16" and config["initial_scale"] == 64.0


def test_config_round_trip():
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.3, momentum=0.5), op=hvd.Sum, backward_passes_per_step=3)
    config = opt.get_config()
    assert (config["op"], config["backward_passes_per_step"], config["compression"]) == ("sum", 3, "none")
    again = hvd.DistributedOptimizer.from_config(config)
    assert again.reduction.op == "sum" and again.accumulation.steps == 3
    assert float(again.inner_optimizer.learning_rate) == pytest.approx(0.3)


@pytest.mark.parametrize("make, error, match", [
    (lambda: hvd.DistributedOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD())), dualframe.StrategyError,
     "already distributed"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        hvd.DistributedOptimizer(keras.optimizers.SGD()))), dualframe.StrategyError, "already distributed"),
    (lambda: hvd.DistributedOptimizer("sgd"), TypeError, r"keras.optimizers.Optimizer \(got str"),
    (lambda: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1)), TypeError, "got Gradient"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op="mean"), dualframe.StrategyError, "unknown op 'mean'"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), compression="int8"), dualframe.StrategyError,
     "unknown compression 'int8'"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), compression=object()), dualframe.StrategyError,
     "unknown compression"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0), dualframe.StrategyError,
     r"backward_passes_per_step must be an int >= 1 \(backward_passes_per_step: 0\)"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), average_aggregated_gradients="yes"),
     dualframe.StrategyError, "average_aggregated_gradients must be True or False"),
    (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum, gradient_predivide_factor=2.0),
     dualframe.StrategyError, "gradient_predivide_factor only applies to op='average'"),
])
def test_bad_optimizer_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_end(self, batch, logs=None):
        self.rates.append(round(float(self.model.optimizer.learning_rate), 6))


def test_learning_rate_callbacks_set_the_rate_per_batch_and_per_epoch():
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mse")
    recorder = Recorder()
    ramp = hvd.callbacks.LearningRateScheduleCallback(0.4, lambda epoch: epoch + 1, end_epoch=1, staircase=False)
    step = hvd.callbacks.LearningRateScheduleCallback(0.4, 0.5, start_epoch=1)
    m.fit(*xy(rows=16), batch_size=4, epochs=2, verbose=0, callbacks=[ramp, step, recorder])
    assert recorder.rates == [0.4, 0.5, 0.6, 0.7, 0.2, 0.2, 0.2, 0.2]
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.8, warmup_epochs=2)
    assert warmup.learning_rate_at(0.0) == pytest.approx(0.8 / hvd.size())
    assert warmup.learning_rate_at(2.0) == pytest.approx(0.8)


def test_broadcast_callback_local_variables_must_be_variables():
    with pytest.raises(dualframe.StrategyError, match=r"local_variables must be variables \(got ndarray\)"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.zeros(2)])
    kept = keras.Variable(np.ones(2, dtype="float32"))
    assert hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[kept]).local_variables == [kept]


def test_callback_argument_checks():
    with pytest.raises(dualframe.StrategyError, match="root_rank must be an int >= 0"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(-1)
    with pytest.raises(dualframe.StrategyError, match="warmup_epochs must be an int >= 1"):
        hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0)
    with pytest.raises(dualframe.StrategyError, match="end_epoch must be after start_epoch"):
        hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=3, end_epoch=2)


def test_broadcast_callback_builds_the_optimizer_before_the_first_batch():
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam()), loss="mse")
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    callback.set_model(m)
    callback.on_train_begin()
    assert m.optimizer.built and callback.broadcast_done
    assert len(m.optimizer.inner_optimizer.variables) > 2  # Adam's slots exist before any update


def test_broadcast_model_needs_a_built_model():
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    unbuilt.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD()), loss="mse")
    with pytest.raises(dualframe.StrategyError, match="has no variables yet: build it first"):
        hvd.broadcast_model(unbuilt)
    assert not unbuilt.optimizer.built  # left for fit to build with the real variables


def test_rank_zero_helpers():
    checkpoint = keras.callbacks.CSVLogger("/dev/null")
    assert hvd.callbacks.rank_zero_only(checkpoint) == [checkpoint]
    assert hvd.verbose(2) == 2


def test_distribute_checks_the_model_and_strategy():
    m = model()
    with pytest.raises(dualframe.StrategyError, match="compile the model before distribute"):
        hvd.distribute(m, dualframe.DataParallel())
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(dualframe.StrategyError, match="handles dualframe.DataParallel"):
        hvd.distribute(m, dualframe.Pipeline([1, 1], chunks=2))
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    unbuilt.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(dualframe.StrategyError, match="build the model"):
        hvd.distribute(unbuilt)
    distributed = hvd.distribute(m, dualframe.DataParallel(compression="fp16", backward_passes_per_step=2))
    assert distributed.optimizer.reduction.compression is hvd.Compression.fp16
    with pytest.raises(dualframe.StrategyError, match="already distributed"):
        hvd.distribute(m)

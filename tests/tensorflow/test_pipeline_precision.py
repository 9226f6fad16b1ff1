"""Loss scaling in a one-stage Keras DistributedPipeline (one process): fit with a LossScaleOptimizer equals Keras's, the scale's growth and skips too."""
import keras
import numpy as np
import pytest

import dualframe.tensorflow as hvd
from dualframe.errors import StrategyError
from dualframe.tensorflow.pipeline.precision import PipelineLossScaleOptimizer


def build():
    """d1, d2 in mixed_float16, the output Dense in float32 (Keras's advice)."""
    keras.utils.set_random_seed(3)
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(12, activation="tanh", name="d1", dtype="mixed_float16")(x)
    h = keras.layers.Dense(12, activation="relu", name="d2", dtype="mixed_float16")(h)
    return keras.Model(x, keras.layers.Dense(2, name="d3", dtype="float32")(h))


def data():
    rng = np.random.RandomState(1)
    return rng.randn(64, 5).astype("float32"), rng.randn(64, 2).astype("float32")


def loss_scaled(initial_scale):
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=initial_scale,
                                               dynamic_growth_steps=3)


@pytest.mark.parametrize("initial_scale, made", [(2.0 ** 10, False), (2.0 ** 120, False), (2.0 ** 10, True)])
def test_fit_with_a_loss_scale_optimizer_equals_keras_fit(initial_scale, made):
    """2**10: the scale doubles every 3 steps (8 steps: 2**12); 2**120: the first steps overflow and are skipped.
    made: compile takes the optimizer ``distributed_optimizer`` returned, and the loss stays scaled."""
    hvd.init()
    x, y = data()
    reference = build()
    reference.compile(loss_scaled(initial_scale), loss="mse")
    want = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    pipe = hvd.DistributedPipeline(build(), stages=1, chunks=4)
    given = pipe.distributed_optimizer(loss_scaled(initial_scale)) if made else loss_scaled(initial_scale)
    pipe.compile(given, loss="mse")
    assert (pipe.optimizer is given) == made
    got = pipe.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert isinstance(pipe.optimizer, PipelineLossScaleOptimizer)
    assert got == pytest.approx(want, abs=2e-3)
    for a, b in zip(pipe.gather_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)
    assert float(pipe.optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale)
    assert int(pipe.optimizer.step_counter) == int(reference.optimizer.step_counter)
    if initial_scale == 2.0 ** 10:
        assert float(pipe.optimizer.dynamic_scale) == 2.0 ** 12 and want[1] < want[0] - 0.05  # it trains
    else:
        assert float(pipe.optimizer.dynamic_scale) < 2.0 ** 120


def test_a_loss_scale_optimizer_the_pipeline_did_not_make_is_refused():
    hvd.init()
    x, y = data()
    pipe = hvd.DistributedPipeline(build(), stages=1, chunks=2, loss_fn="mse")
    pipe.train_step(x[:16], y[:16])
    before = pipe.get_weights()
    with pytest.raises(StrategyError, match="never scaled"):
        pipe.apply_gradients(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    for a, b in zip(pipe.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_distributed_optimizer_under_the_mixed_float16_policy_scales_the_loss():
    hvd.init()
    policy = keras.mixed_precision.global_policy()
    try:
        keras.mixed_precision.set_global_policy("mixed_float16")
        pipe = hvd.DistributedPipeline(build(), stages=1, chunks=2, loss_fn="mse")
        optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.1))
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert isinstance(optimizer, PipelineLossScaleOptimizer) and float(optimizer.dynamic_scale) == 2.0 ** 15
    x, y = data()
    plain = hvd.DistributedPipeline(build(), stages=1, chunks=2, loss_fn="mse")  # no optimizer: no loss scale
    want = plain.train_step(x[:16], y[:16])
    assert pipe.train_step(x[:16], y[:16]) == pytest.approx(want, abs=1e-3)  # reported unscaled
    for scaled, unscaled in zip(pipe.gradients, plain.gradients):  # arrive scaled by 2**15
        np.testing.assert_allclose(np.asarray(scaled) / 2.0 ** 15, np.asarray(unscaled), atol=1e-3, rtol=1e-2)
    assert max(np.abs(np.asarray(g)).max() for g in pipe.gradients) > 100


def test_a_stage_checkpoint_keeps_the_scale_and_its_counter(tmp_path):
    hvd.init()
    x, y = data()
    pipe = hvd.DistributedPipeline(build(), stages=1, chunks=2, loss_fn="mse")
    optimizer = pipe.distributed_optimizer(loss_scaled(2.0 ** 120))
    for step in range(2):  # two overflowing steps skipped (2**118), then one applied (counter 1)
        pipe.train_step(x[:16], y[:16])
        pipe.apply_gradients(optimizer)
    assert float(optimizer.dynamic_scale) == 2.0 ** 118
    optimizer.dynamic_scale.assign(2.0 ** 9)
    pipe.train_step(x[:16], y[:16])
    pipe.apply_gradients(optimizer)
    assert (float(optimizer.dynamic_scale), int(optimizer.step_counter)) == (2.0 ** 9, 1)
    hvd.save_stage_checkpoint(str(tmp_path), pipe, optimizer, step=3)
    fresh = hvd.DistributedPipeline(build(), stages=1, chunks=2, loss_fn="mse")
    loaded = fresh.distributed_optimizer(loss_scaled(2.0 ** 15))
    hvd.load_stage_checkpoint(str(tmp_path), fresh, loaded)
    assert (float(loaded.dynamic_scale), int(loaded.step_counter)) == (2.0 ** 9, 1)
    for a, b in zip(fresh.get_weights(), pipe.get_weights()):
        np.testing.assert_array_equal(a, b)

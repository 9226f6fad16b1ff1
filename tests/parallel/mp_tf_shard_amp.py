"""Mixed precision with the Keras sharded optimizer on 2 ranks: mixed policies, LossScaleOptimizer, fp32 master slices.

Every rank runs every test. ``fit`` and a GradientTape loop under ``mixed_float16`` (loss scaling) and
``mixed_bfloat16`` compare with plain data parallelism under the same policy. An inf in one rank's
slice must skip the step on both ranks and halve the scale on both. The torch twin: mp_torch_shard_amp.py.
# timeout: 600
"""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe.tensorflow.keras as hvd
from dualframe.tensorflow.dp.shard.precision import ShardedLossScaleOptimizer
# tests/parallel is on sys.path (pytest rootdir import)
from keras_dp_helpers import FEATURES, PER_RANK, SEED0, data, flat, make_model, rank_fit, rank_rows

hvd.init()
SIZE, RANK, STEPS = hvd.size(), hvd.rank(), 3


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_dtype_policy(request.param)
    yield request.param
    keras.mixed_precision.set_dtype_policy("float32")


def loss_scaled(initial_scale=1024.0, growth=2):
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=initial_scale,
                                               dynamic_growth_steps=growth)


def fitted(shard, policy, x, y):
    optimizer = loss_scaled() if policy == "mixed_float16" else keras.optimizers.Adam(0.01)
    opt = hvd.DistributedOptimizer(optimizer, shard=shard)
    return rank_fit(make_model(SEED0 + RANK), opt, x, y), opt


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_mixed_policy_fit_equals_plain_data_parallel(policy, shard):
    x, y = data(steps=STEPS, seed=30)
    model, opt = fitted(shard, policy, x, y)
    plain, plain_opt = fitted(None, policy, x, y)
    assert model.optimizer is opt  # compile kept it: under mixed_float16 it is a LossScaleOptimizer already
    np.testing.assert_allclose(flat(model), flat(plain), atol=1e-5)
    sharded = opt.inner_optimizer if policy == "mixed_float16" else opt
    if policy == "mixed_float16":
        assert isinstance(opt, ShardedLossScaleOptimizer)
        assert float(opt.dynamic_scale) == float(plain_opt.dynamic_scale) == 2048.0  # grown once in 3 steps
    # Mixed policies keep float32 variables: the slices (the masters) are float32, half of the state per rank.
    assert all(s.dtype == "float32" for s in sharded._zero.slices)
    full = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables) * 2  # Adam: m and v
    assert sharded.state_bytes() <= full // SIZE + 64


def tape_steps(opt, model, x, y, edit=None, steps=STEPS):
    """A GradientTape loop on this rank's rows, the loss scaled by the optimizer; ``edit`` may change the gradients."""
    for k in range(steps):
        xs, ys = (rank_rows(a)[k * PER_RANK:(k + 1) * PER_RANK] for a in (x, y))
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(keras.ops.cast(model(xs), "float32") - ys))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(edit(grads) if edit else grads, model.trainable_variables)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_mixed_float16_gradient_tape_equals_plain_data_parallel(policy, shard):
    x, y = data(steps=STEPS, seed=31)
    results = []
    for mode in (shard, None):
        model, opt = make_model(SEED0), hvd.DistributedOptimizer(loss_scaled(), shard=mode)
        tape_steps(opt, model, x, y)
        results.append((flat(model), float(opt.dynamic_scale)))
    np.testing.assert_allclose(results[0][0], results[1][0], atol=1e-5)
    assert results[0][1] == results[1][1] == 2048.0


def inf_on_rank_1(grads):
    """Rank 1 puts an inf in the last element of the last gradient: after the reduction only its owner, rank 1, sees it."""
    if RANK != 1:
        return grads
    last = grads[-1]
    mask = np.zeros(last.shape, "float32")
    mask.reshape(-1)[-1] = np.inf
    return list(grads[:-1]) + [last + keras.ops.cast(mask, last.dtype)]


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_inf_in_one_ranks_slice_skips_the_step_on_every_rank(policy, shard):
    x, y = data(steps=STEPS, seed=32)
    model = make_model(SEED0)
    opt = hvd.DistributedOptimizer(loss_scaled(growth=2), shard=shard, scatter="reducescatter")
    opt.build(model.trainable_variables)
    before = flat(model)
    tape_steps(opt, model, x, y, inf_on_rank_1, steps=1)
    np.testing.assert_array_equal(flat(model), before)  # skipped on both ranks
    assert int(opt.iterations) == 0
    scales = hvd.allgather(tf.reshape(opt.dynamic_scale, [1])).numpy()
    assert scales.tolist() == [512.0] * SIZE
    tape_steps(opt, model, x, y)  # 3 good steps: grown once (growth 2), on both ranks
    scales = hvd.allgather(tf.reshape(opt.dynamic_scale, [1])).numpy()
    assert scales.tolist() == [1024.0] * SIZE and int(opt.iterations) == STEPS

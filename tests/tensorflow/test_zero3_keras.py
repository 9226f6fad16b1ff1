"""Keras ZeRO-3 (``shard="parameters"``) in one process: equal to the plain optimizer with dropout and batch norm."""
import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe
import dualframe.tensorflow.keras as hvd
from dualframe.plan import Hardware, Training, advise
from dualframe.plan.profile import Shared
from dualframe.tensorflow.dp.shard import parameters as sharded_parameters
from dualframe.tensorflow.plan.probe import profile_model

hvd.init()


def model(seed=0):
    """Dense -> BatchNormalization -> Dropout -> residual Dense -> Dense (a non-trainable state in two layers)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    hidden = keras.layers.Dropout(0.3, seed=seed)(keras.layers.BatchNormalization()(hidden))
    hidden = keras.layers.Add()([hidden, keras.layers.Dense(8)(hidden)])
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def data():
    rng = np.random.RandomState(0)
    x = rng.randn(24, 5).astype("float32")
    return x, np.tanh(x.sum(1, keepdims=True))


@pytest.mark.parametrize("bucket_elements, keep_gathered", [(None, 1), (20, 1), (None, 0), (None, 4)])
def test_fit_with_dropout_and_batch_norm_equals_plain(bucket_elements, keep_gathered):
    """The recompute draws the forward's dropout mask; the forward's batch-norm updates are kept, once.

    ``keep_gathered``: the last layers' backward on the forward's own tape (1: the last; 4: every layer, none
    recomputed; 0: every layer recomputed)."""
    x, y = data()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), shard="parameters", bucket_elements=bucket_elements,
                                   keep_gathered=keep_gathered)
    sharded = opt.shard_model(model())
    sharded.compile(optimizer=opt, loss="mse")
    plain = model()
    plain.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    for m in (sharded, plain):
        m.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(sharded.get_weights(), plain.get_weights()):  # moving statistics included
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(sharded.predict(x, verbose=0), plain.predict(x, verbose=0), atol=1e-6)
    np.testing.assert_allclose(sharded.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0), atol=1e-6)
    # No bucket spans two layers (each layer gathers its own); bucket_elements=20 cuts the larger ones.
    # The core's plan (dualframe.dp.zero3): each layer with weights a block, its buckets its own.
    owned = sorted(b for buckets in opt._zero.blocks.values() for b in buckets)
    assert owned == list(range(len(opt._zero.layout.buckets))) == list(range(4 if bucket_elements is None else 6))
    assert len(opt._zero.blocks) == 4
    kept = [layer.call.args[0].kept for layer in sharded.layers if layer.trainable_weights]
    assert kept == [False] * (4 - keep_gathered) + [True] * keep_gathered  # the last ones of the forward


def test_set_weights_and_the_refusals():
    x, y = data()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="parameters")
    sharded = opt.shard_model(model(1))
    weights = model(2).get_weights()
    sharded.set_weights(weights)
    for a, b in zip(sharded.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(dualframe.StrategyError, match="one array per weight"):
        sharded.set_weights(weights[:-1])
    with pytest.raises(dualframe.StrategyError, match="already holds a model's slices"):
        opt.shard_model(model(1))
    with pytest.raises(dualframe.StrategyError, match="apply the gradients of opt.parameter_slices"):
        opt.apply([None] * len(sharded.trainable_variables), sharded.trainable_variables)
    with pytest.raises(dualframe.StrategyError, match="cannot be re-cut"):
        opt.reshard()
    assert hvd.DistributedOptimizer.from_config(opt.get_config()).shard == "parameters"
    with pytest.raises(dualframe.StrategyError, match="keep_gathered= is for shard='parameters'"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="gradients", keep_gathered=1)
    with pytest.raises(dualframe.StrategyError, match="keep_gathered= is for shard='parameters'"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), keep_gathered=1)
    with pytest.raises(dualframe.StrategyError, match="keep_gathered must be an int >= 0"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="parameters", keep_gathered=-1)
    # Keras's own LossScaleOptimizer around it would decide each rank's skip alone: refused when fit traces.
    scaled = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="parameters")
    wrapped = scaled.shard_model(model(1))
    wrapped.compile(optimizer=keras.optimizers.LossScaleOptimizer(scaled), loss="mse")
    with pytest.raises(dualframe.StrategyError, match="needs hvd.DistributedOptimizer to make the LossScaleOptimizer"):
        wrapped.fit(x, y, batch_size=6, verbose=0)


def test_embeddings_of_token_ids_frozen_and_trained_equal_plain():
    """A layer with integer inputs only: its gradient goes to its slices alone; a frozen one just reads its state."""
    def embedded():
        keras.utils.set_random_seed(3)
        ids = keras.Input((4,), dtype="int32")
        summed = keras.layers.Add()([keras.layers.Embedding(10, 3, trainable=False)(ids),
                                     keras.layers.Embedding(10, 3)(ids)])
        return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(summed)))

    x = np.random.RandomState(0).randint(0, 10, (8, 4)).astype("int32")
    y = np.linspace(-1, 1, 8, dtype="float32")[:, None]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="parameters")
    sharded = opt.shard_model(embedded())
    sharded.compile(optimizer=opt, loss="mse")
    plain = embedded()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for m in (sharded, plain):
        m.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert np.abs(plain.get_weights()[1] - embedded().get_weights()[1]).max() > 1e-3  # the trained one moved


@pytest.mark.parametrize("policy, keep_gathered", [("mixed_float16", 1), ("mixed_bfloat16", 1), ("mixed_float16", 5)])
def test_mixed_policy_gathers_the_float32_masters_and_keeps_the_state_exact(policy, keep_gathered):
    """Eager (no fused kernels): the slices' gradients equal the plain model's bit for bit, in float32; a
    frozen kernel and batch-norm statistics read in the compute dtype are not written back rounded to it.
    ``keep_gathered=5``: no layer recomputed, each backward on its forward's tape."""
    def mixed():
        keras.utils.set_random_seed(4)
        inputs = keras.Input((5,))
        hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8, activation="tanh")(inputs))
        frozen = keras.layers.Dense(8, trainable=False)(keras.layers.Add()([hidden, keras.layers.Dense(8)(hidden)]))
        return keras.Model(inputs, keras.layers.Dense(1)(frozen))

    keras.mixed_precision.set_dtype_policy(policy)
    try:
        x, y = data()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), shard="parameters", keep_gathered=keep_gathered)
        sharded, plain = opt.shard_model(mixed()), mixed()
        gradients = []
        for model, wrt in ((sharded, opt.parameter_slices()), (plain, plain.trainable_variables)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), "float32") - y))
            gradients.append(tape.gradient(loss, wrt))
        sharded_opt = getattr(opt, "inner_optimizer", opt)  # mixed_float16: inside a ShardedLossScaleOptimizer
        for a, b in zip(sharded_opt._zero.unflatten(gradients[0]), gradients[1]):
            assert a.dtype == b.dtype == tf.float32
            np.testing.assert_array_equal(a, b)
        assert all(s.dtype == "float32" for s in opt.parameter_slices())
        for a, b in zip(sharded.get_weights(), plain.get_weights()):  # the moving statistics moved alike
            np.testing.assert_array_equal(a, b)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def test_the_plan_offers_zero3_for_a_layer_called_twice_and_not_for_a_layer_two_models_share():
    """``dualframe plan``'s Keras probe lists a variable held by two top-level layers as shared (counted once),
    and the advisor then leaves out the ZeRO-3 row, which shard_model would refuse; one layer called twice
    holds its variables once: offered, and equal to the plain model."""
    def twice():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((5,))
        dense = keras.layers.Dense(5, activation="tanh")
        return keras.Model(inputs, keras.layers.Dense(1)(dense(dense(inputs))))

    def nested():
        keras.utils.set_random_seed(6)
        inputs = keras.Input((5,))
        shared = keras.layers.Dense(5)
        inner = keras.Model(inputs, keras.layers.Dense(1)(shared(inputs)))
        return keras.Model(inputs, inner(keras.Sequential([shared])(inputs)))

    hardware, zero3 = Hardware(memory_per_device=1e9, devices_per_node=2), "data parallel + sharded parameters"
    offered = profile_model(twice(), (5,))
    assert offered.shared == () and offered.parameters == 5 * 5 + 5 + 5 + 1
    assert zero3 in [o.kind for o in advise(offered, Training(8), hardware).options]
    x, y = data()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), shard="parameters")
    sharded, plain = opt.shard_model(twice()), twice()
    sharded.compile(optimizer=opt, loss="mse")
    plain.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    for m in (sharded, plain):
        m.fit(x, y, batch_size=6, shuffle=False, verbose=0)
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)

    refused = profile_model(nested(), (5,))
    assert refused.shared == (Shared(5 * 5, (0, 1)), Shared(5, (0, 1))) and refused.parameters == 5 * 5 + 5 + 5 + 1
    assert zero3 not in [o.kind for o in advise(refused, Training(8), hardware).options]
    with pytest.raises(dualframe.StrategyError, match="shared between nested models"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), shard="parameters").shard_model(nested())


def layered(policy):
    """Two Dense layers of ``policy`` (dtype='float16': float16 variables) and a float32 head."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh", dtype=policy)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, dtype=policy)(hidden)))


def eager_steps(pairs, steps=2):
    """``steps`` eager steps of each (model, optimizer, variables to differentiate and apply to)."""
    x, y = data()
    for model, step, wrt in pairs:
        for _ in range(steps):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), "float32") - y))
            step.apply(tape.gradient(loss, wrt), wrt)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_variables_step_through_fp32_master_slices(dtype):
    """Layers with dtype='float16' (variables in float16): the slices are float32 masters, and two eager SGD
    steps equal, bit for bit, the same layers with dtype='mixed_float16' (float32 variables) from equal values."""
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5, momentum=0.9), shard="parameters")
    sharded, plain = opt.shard_model(layered(dtype)), layered(f"mixed_{dtype}")
    plain.set_weights(sharded.get_weights())
    plain_opt = keras.optimizers.SGD(0.5, momentum=0.9)
    eager_steps([(sharded, opt, opt.parameter_slices()), (plain, plain_opt, plain.trainable_variables)])
    assert [str(v.dtype) for v in sharded.trainable_variables[:2]] == [dtype, dtype]
    assert all(s.dtype == "float32" for s in opt.parameter_slices())
    masters = [np.asarray(v) for v in sharded_parameters.gather(opt)]
    for master, full in zip(masters, plain.get_weights()):
        np.testing.assert_array_equal(master, full)
    weights = sharded.get_weights()
    assert weights[0].dtype == np.dtype(dtype) if dtype == "float16" else str(weights[0].dtype) == "bfloat16"
    assert np.abs(masters[0] - weights[0].astype("float32")).max() > 0  # the masters keep more digits


@pytest.mark.parametrize("loss_scale", [False, True])
def test_build_again_keeps_the_slices_and_slots_and_fit_equals_plain(loss_scale):
    """``build`` twice, on the model's variables or on the slices, and ``fit`` after it: one state, not two;
    other variables are refused. With a LossScaleOptimizer the scale and its counter stay the ones built."""
    x, y = data()
    adam = keras.optimizers.Adam(0.05)
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(adam) if loss_scale else adam,
                                   shard="parameters")
    sharded = opt.shard_model(model())
    sharded_opt = getattr(opt, "inner_optimizer", opt)
    slices, state = opt.parameter_slices(), list(opt.variables)
    for variables in (sharded.trainable_variables, opt.parameter_slices(), sharded.trainable_variables):
        opt.build(variables)
    assert all(a is b for a, b in zip(opt.parameter_slices(), slices)) and len(opt.parameter_slices()) == len(slices)
    assert len(opt.variables) == len(state) and all(a is b for a, b in zip(opt.variables, state))
    assert len(sharded_opt._zero.inner.variables) == 1 + 1 + 2 * len(slices)  # iterations, lr, Adam's m and v
    with pytest.raises(dualframe.StrategyError, match="built on its model.s 8 trainable variables and cannot be built again on 8 others"):
        opt.build(model().trainable_variables)
    sharded.compile(optimizer=opt, loss="mse")
    plain = model()
    plain.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    for m in (sharded, plain):
        m.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert len(opt.variables) == len(state) and len(sharded_opt._zero.inner.variables) == 2 + 2 * len(slices)
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_zero2_build_again_and_fit_after_a_manual_build_keep_one_state():
    x, y = data()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), shard="gradients")
    sharded = model()
    opt.build(sharded.trainable_variables)
    slots = opt.shard_variables()
    opt.build(sharded.trainable_variables)
    assert len(opt.shard_variables()) == len(slots) and all(a is b for a, b in zip(opt.shard_variables(), slots))
    with pytest.raises(dualframe.StrategyError, match="cannot be built again"):
        opt.build(model().trainable_variables[:2])
    sharded.compile(optimizer=opt, loss="mse")
    plain = model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    for m in (sharded, plain):
        m.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert all(a is b for a, b in zip(opt.shard_variables(), slots))
    for a, b in zip(sharded.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_state_exports_as_plain_keras_holds_it_and_loads_either_way(dtype):
    """The exported slots of float16 variables are float16, as a plain Adam built on the same model keeps
    them (its load_own_variables takes them); they are the fp32 master slots rounded. Loading takes them, or
    float32 slots (then kept whole: equal to the fp32 reference's, bit for bit)."""
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), shard="parameters")
    sharded, reference = opt.shard_model(layered(dtype)), layered(f"mixed_{dtype}")
    reference.set_weights(sharded.get_weights())
    reference_opt = keras.optimizers.Adam(0.05)
    eager_steps([(sharded, opt, opt.parameter_slices()), (reference, reference_opt, reference.trainable_variables)])
    plain_opt = keras.optimizers.Adam(0.05)
    plain_opt.build(layered(dtype).trainable_variables)
    arrays, masters = opt.state_arrays(), [np.asarray(v) for v in reference_opt.variables]
    assert [str(a.dtype) for a in arrays] == [str(v.dtype) for v in plain_opt.variables]
    assert {str(a.dtype) for a in arrays if a.ndim} == {dtype, "float32"}  # the float32 head's slots stay float32
    for got, master in zip(arrays, masters):
        np.testing.assert_array_equal(got, master.astype(got.dtype))
    store = {}
    opt.save_own_variables(store)
    plain_opt.load_own_variables(store)  # plain Keras, no dualframe
    for variable, array in zip(plain_opt.variables, arrays):
        np.testing.assert_array_equal(np.asarray(variable), array)
    for given in (arrays, masters):
        fresh = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), shard="parameters")
        fresh.shard_model(layered(dtype))
        fresh.load_state_arrays(given)
        zero = fresh._zero
        names, first = zero.slot_names(), len(zero.replicated_variables())
        slots = {(b, name): np.asarray(v) for b, name, v in zero._slots()}
        assert all(v.dtype == np.float32 for v in slots.values())
        for t in range(len(zero.variables)):
            b, offset, size = zero._where(t)
            for k, name in enumerate(names):
                np.testing.assert_array_equal(slots[(b, name)][offset:offset + size],
                                              np.asarray(given[first + t * len(names) + k]).astype("float32").ravel())

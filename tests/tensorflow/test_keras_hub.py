"""Models nobody here wrote, split in one process: keras_hub backbones, keras.applications, Dropout under ``training``.

In float64 (``keras.config.set_floatx`` and the dtype policy), so the split's loss and every gradient equal the unsplit
model's to 1e-9. Each split runs the model's own layers, so the reference is the same model object;
with Dropout on, the seed generators' states are put back before each run, so the masks are drawn
from the same state: one micro-batch draws what the unsplit model draws; several draw one mask each.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from tests.parallel.keras_hub_models import HIDDEN, LENGTH, bert, gpt2, tokens

pytest.importorskip("keras_hub")

ATOL = 1e-9
DEVICES = ["/CPU:1", "/CPU:2"]


pytestmark = pytest.mark.usefixtures("keras_float64")


def dropout_net(rate):
    keras.utils.set_random_seed(3)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="d0")(x)
    h = keras.layers.Dropout(rate, seed=4, name="drop")(h)
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8, name="d1")(h))
    return keras.Model(x, keras.layers.Dense(2, name="head")(h))


def loss_of(outputs):
    return sum(tf.reduce_mean(tf.square(y - 0.1)) for y in keras.tree.flatten(outputs))


def run(model, inputs, training=True):
    with tf.GradientTape() as tape:
        loss = loss_of(model(inputs, training=training))
    return loss, tape.gradient(loss, model.trainable_variables)


def assert_same(got, want, atol=ATOL):
    np.testing.assert_allclose(float(got[0]), float(want[0]), atol=atol, rtol=0)
    assert len(got[1]) == len(want[1])
    for k, (a, b) in enumerate(zip(got[1], want[1])):
        np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy(), atol=atol, rtol=0,
                                   err_msg=f"gradient {k}")


def seed_states(model):
    """The model's seed generator states (Dropout's), to draw the same masks again."""
    return [(v, v.numpy()) for v in model.variables if "seed_generator_state" in v.path]


@pytest.mark.parametrize("make, split", [(gpt2, hvd.ModelParallel), (bert, hvd.ModelParallel),
                                         (gpt2, hvd.Pipeline), (bert, hvd.Pipeline)])
def test_backbone_cut_inside_the_stack_equals_the_unsplit_model(make, split):
    model = make()
    x = tokens(model)
    want = run(model, x)
    chunks = {"chunks": 3, "checkpoint": "except_last"} if split is hvd.Pipeline else {}
    pipe = split(model, split_points=["transformer_layer_1"], devices=DEVICES, **chunks)
    assert_same(run(pipe, x), want)


def test_stages_and_balance_count_the_transformer_layers():
    model = gpt2(layers=4)
    by_memory = hvd.ModelParallel(model, stages=2, by="memory", devices=DEVICES)
    by_balance = hvd.ModelParallel(model, balance=[2, 2], devices=DEVICES)
    assert by_memory.split_points == by_balance.split_points == ("transformer_layer_2",)
    assert "8 layers (2 blocks), token_ids .. transformer_layer_1" in by_balance.describe()
    assert hvd.ModelParallel(bert(), balance=[1, 2], devices=DEVICES).split_points == ("transformer_layer_1",)
    by_time = hvd.ModelParallel(model, stages=2, sample=tokens(model), devices=DEVICES)  # a dict sample, timed
    assert by_time.split_points[0] in {"transformer_layer_1", "transformer_layer_2", "transformer_layer_3"}


def test_fit_with_dict_inputs_trains_as_the_unsplit_model():
    x = tokens(gpt2(), rows=8)
    y = np.random.RandomState(5).randn(8, LENGTH, HIDDEN)
    weights = []
    for split in (None, hvd.ModelParallel, hvd.Pipeline):
        model = gpt2(layers=2, dropout=0.1)  # dropout on: fit passes training=True to every Dropout
        trained = model if split is None else split(model, balance=[1, 1], devices=DEVICES)
        trained.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # one batch: one mask per Dropout
        weights.append(model.get_weights())
    for got in weights[1:]:
        for a, b in zip(got, weights[0]):
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", [hvd.ModelParallel, hvd.Pipeline])
def test_dropout_and_batch_norm_take_training_as_the_unsplit_model(split):
    x = tf.constant(np.random.RandomState(6).randn(8, 6))
    off = dropout_net(0.0)
    pipe = split(off, split_points=["d1"], devices=DEVICES)
    assert_same(run(pipe, x), run(off, x))
    on = dropout_net(0.5)
    kept = seed_states(on)
    want = run(on, x)
    for variable, value in kept:
        variable.assign(value)
    pipe = split(on, split_points=["d1"], devices=DEVICES)
    assert_same(run(pipe, x), want)  # one micro-batch: the masks the unsplit model drew
    np.testing.assert_allclose(pipe(x, training=False).numpy(), on(x, training=False).numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_dropout_with_micro_batches_equals_the_unsplit_model_fed_them_in_turn(checkpoint):
    """A recomputed micro-batch draws its forward's Dropout mask again and moves the BatchNorm statistics once."""
    model = dropout_net(0.5)
    x = tf.constant(np.random.RandomState(7).randn(8, 6))
    kept = [(v, v.numpy()) for v in model.non_trainable_variables]  # seed generator states, moving statistics
    with tf.GradientTape() as tape:  # each call of the Dropout draws the next mask, as each micro-batch does
        loss = loss_of(tf.concat([model(x[:4], training=True), model(x[4:], training=True)], 0))
    want = loss, tape.gradient(loss, model.trainable_variables)
    after = [v.numpy() for v, _ in kept]
    for variable, value in kept:
        variable.assign(value)
    pipe = hvd.Pipeline(model, split_points=["d1"], devices=DEVICES, chunks=2, checkpoint=checkpoint)
    assert_same(run(pipe, x), want)
    for (variable, _), value in zip(kept, after):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)


def test_fit_with_recomputed_micro_batches_trains_as_without():
    """Dropout and BatchNorm in fit (a compiled step): checkpointing every micro-batch changes nothing, bit for bit."""
    x, y = np.random.RandomState(8).randn(8, 6), np.random.RandomState(9).randn(8, 2)
    weights = []
    for checkpoint in ("never", "always"):
        model = dropout_net(0.5)
        pipe = hvd.Pipeline(model, split_points=["d1"], devices=DEVICES, chunks=2, checkpoint=checkpoint)
        pipe.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        pipe.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append([v.numpy() for v in model.variables])
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_keras_application_split_by_memory_equals_the_unsplit_model():
    model = mobilenet()
    x = tf.constant(np.random.RandomState(9).randn(4, 32, 32, 3))
    want = run(model, x)
    pipe = hvd.ModelParallel(model, stages=2, by="memory", devices=DEVICES)
    assert_same(run(pipe, x), want)


def mobilenet():
    keras.utils.set_random_seed(8)
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=5)


@pytest.mark.parametrize("split", [hvd.ModelParallel, hvd.Pipeline])
def test_keras_application_fit_keeps_the_batch_norm_statistics_of_the_unsplit_model(split):
    """fit with one micro-batch: every weight, the BatchNormalization moving means and variances among them, as unsplit."""
    x, y = np.random.RandomState(9).randn(4, 32, 32, 3), np.random.RandomState(10).randn(4, 5)
    weights = []
    for make in (lambda m: m, lambda m: split(m, stages=2, by="memory", devices=DEVICES)):
        model = mobilenet()
        trained = make(model)
        trained.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        trained.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights.append({v.path: v.numpy() for v in model.weights})
    assert sum("moving_" in path for path in weights[0]) == 104  # 52 BatchNormalization layers
    assert weights[1].keys() == weights[0].keys()
    for path, value in weights[0].items():
        np.testing.assert_allclose(weights[1][path], value, atol=ATOL, rtol=0, err_msg=path)

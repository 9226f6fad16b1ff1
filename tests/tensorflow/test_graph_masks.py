"""Keras's implicit masks (``Embedding(mask_zero=True)``) across the cuts of a one-process split: equal to the unsplit model.

In float64, so the loss, every gradient and the weights after ``fit`` equal the unsplit model's to 1e-9.
Each split runs the model's own layers, so the reference is the same model object. The loss is a Keras
``MeanSquaredError``, which weighs the tokens of a masked output by its mask, as ``fit`` does.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.errors import StageError
from tests.parallel.keras_mask_models import MODELS, padded_batches, sequential

ATOL = 1e-9
DEVICES = ["/CPU:1", "/CPU:2"]
CUTS = {"recurrent": ["scale", "attention", "lstm", "pool", "head"], "attention": ["proj", "attention", "tokens"]}
SPLITS = {"model_parallel": (hvd.ModelParallel, {}),
          "pipeline": (hvd.Pipeline, {"chunks": 3, "checkpoint": "except_last"})}


pytestmark = pytest.mark.usefixtures("keras_float64")


def run(model, x, y):
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_variables)


def assert_same(got, want):
    np.testing.assert_allclose(float(got[0]), float(want[0]), atol=ATOL, rtol=0)
    assert len(got[1]) == len(want[1])
    for k, (a, b) in enumerate(zip(got[1], want[1])):
        np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy(), atol=ATOL,
                                   rtol=0, err_msg=f"gradient {k}")


@pytest.mark.parametrize("name, cut", [(name, cut) for name, cuts in CUTS.items() for cut in cuts])
@pytest.mark.parametrize("split", SPLITS)
def test_masks_cross_every_cut(name, cut, split):
    make, outputs = MODELS[name]
    model = make()
    (x, y), = padded_batches(1, 6, outputs)
    want = run(model, x, y)
    cls, kwargs = SPLITS[split]
    pipe = cls(model, split_points=[cut], devices=DEVICES, **kwargs)
    assert_same(run(pipe, x, y), want)
    np.testing.assert_allclose(pipe(x).numpy(), model(x).numpy(), atol=ATOL, rtol=0)


def test_the_mask_crosses_beside_the_tensor_it_belongs_to():
    """The mask of a value read by a later stage is sent with it: the explicit one an LSTM records, or the tensor's own."""
    recurrent = hvd.ModelParallel(MODELS["recurrent"][0](), split_points=["attention"], devices=DEVICES)
    crossing = recurrent.graph_split.crossing(0)  # "scale" and the mask Keras made of ids (a keras.ops.not_equal)
    assert len(crossing) == 2 and crossing[1] == "scale" and recurrent.captured.specs[crossing[0]].dtype == "bool"
    attention = hvd.ModelParallel(MODELS["attention"][0](), split_points=["attention"], devices=DEVICES)
    assert attention.graph_split.crossing(0) == ("embed~mask", "proj")
    assert "embed~mask" in attention.describe()


def test_a_masked_output_weighs_the_loss_as_the_unsplit_model():
    """The attention model's output keeps the embedding's mask: padded tokens count for nothing in the loss."""
    model = MODELS["attention"][0]()
    (x, y), = padded_batches(1, 6, (6, 3))
    pipe = hvd.Pipeline(model, split_points=["tokens"], devices=DEVICES, chunks=2)
    out = pipe(x)
    np.testing.assert_array_equal(keras.src.backend.get_keras_mask(out).numpy(), x != 0)
    padded = y.copy()
    padded[x == 0] += 100.0  # targets of padded tokens do not matter, on the split as on the model
    np.testing.assert_allclose(float(run(pipe, x, padded)[0]), float(run(model, x, y)[0]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_fit_trains_as_the_unsplit_model(name):
    make, outputs = MODELS[name]
    data = padded_batches(2, 6, outputs)
    weights = []
    for split in (None, hvd.ModelParallel, hvd.Pipeline):
        model = make()
        trained = model if split is None else split(model, split_points=[CUTS[name][1]], devices=DEVICES,
                                                        **({"chunks": 2} if split is hvd.Pipeline else {}))
        trained.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        for x, y in data:
            trained.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for got in weights[1:]:
        for a, b in zip(got, weights[0]):
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cut", ["proj", "lstm"])
@pytest.mark.parametrize("split", SPLITS)
def test_a_sequential_on_a_keras_input_carries_its_masks(cut, split):
    model = sequential()
    (x, y), = padded_batches(1, 6, (3,))
    want = run(model, x, y)
    cls, kwargs = SPLITS[split]
    assert_same(run(cls(model, split_points=[cut], devices=DEVICES, **kwargs), x, y), want)


def test_a_list_of_layers_refuses_a_cut_that_would_drop_a_mask():
    layers = sequential(built=False)
    (x, _), = padded_batches(1, 6, (3,))
    with pytest.raises(StageError, match="TraceError: layer .embed. hands a Keras mask to the next stage"):
        hvd.ModelParallel(layers, balance=[1, 3], devices=DEVICES)(x)
    want = x
    for layer in layers:
        want = layer(want)  # the mask stays on the tensors, as inside a stage
    got = hvd.ModelParallel(layers, balance=[3, 1], devices=DEVICES)(x)  # cut after the LSTM, which read the mask
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=ATOL, rtol=0)

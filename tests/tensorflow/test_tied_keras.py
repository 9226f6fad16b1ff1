"""A layer called by stages on two devices in one process (ModelParallel, Pipeline) trains as the unsplit model.

A functional model calling one Dense at its start and its end, and keras_hub's GPT2CausalLM (its head is
the token embedding called in reverse), cut so that the first and the last stage read the same variables,
on "/CPU:1" and "/CPU:2": the loss of 2 SGD steps and every weight after them equal the unsplit model's
(float64, 1e-9). The tied variables are found by identity.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.tensorflow.graph.capture import capture
from dualframe.tensorflow.graph.cut import split_model
from dualframe.tensorflow.split.tied import find_layer_tied
from tests.parallel.keras_pipeline_models import float64_batches, shared_ends, tied_gpt2, token_batches

CASES = {
    "shared_ends": (shared_ends, ["mid"], lambda: float64_batches(2, 4),
                    lambda: keras.losses.MeanSquaredError(dtype="float64")),
    "keras_hub_gpt2": (tied_gpt2, ["token_embedding"], lambda: token_batches(2, 4),
                       lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")),
}


def train(model, data, loss_fn):
    optimizer = keras.optimizers.SGD(0.5)
    losses = []
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


@pytest.mark.parametrize("strategy", [hvd.ModelParallel, hvd.Pipeline])
@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_read_on_two_devices_trains_as_the_unsplit_model(case, strategy):
    make, points, data, loss = CASES[case]
    expected, want = train(make(), data(), loss())
    model = make()
    # The split is a keras.Model too: float32 (the default policy) would cast the float64 inputs.
    split = strategy(model, split_points=points, devices=["/CPU:1", "/CPU:2"], chunks=2, dtype="float64")
    losses, got = train(split, data(), loss())
    assert losses == pytest.approx(expected, abs=1e-9)
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=1e-9, rtol=0, err_msg=f"weight {k}")


@pytest.mark.parametrize("case", list(CASES))
def test_tied_variables_are_found_by_identity(case):
    make, points, _, _ = CASES[case]
    captured = capture(make())
    tied = find_layer_tied(captured, split_model(captured, split_points=points))
    names = {"shared_ends": [("shared/kernel",), ("shared/bias",)], "keras_hub_gpt2": [("token_embedding/embeddings",)]}
    assert [(w.names, w.stages) for w in tied] == [(n, (0, 1)) for n in names[case]]

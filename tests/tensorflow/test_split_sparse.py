"""A one-process Keras split keeps an Embedding's gradient IndexedSlices: under Adam it trains as plain Keras.

Keras's optimizers update only the rows an IndexedSlices lists (Adam squares each listed row and leaves the
others' moments alone), so a gradient made dense trains differently. Two stages on "/CPU:1" and "/CPU:2", 3
Adam steps, every checkpoint mode, a GradientTape loop (eager, recorded, in a tf.function) and ``fit``: the
weights equal plain Keras's (a tape over the unsplit model) at 1e-5.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from tests.parallel.keras_pipeline_models import (T, VOCAB, embedding_batches, encoder_batches, make_embedding_model,
                                                  one_process, tied_gpt2, token_batches)

STEPS, ROWS, CHUNKS, LR = 3, 8, 4, 0.05
DEVICES = ["/CPU:1", "/CPU:2"]


def make_attention_model():
    """(tokens, padding mask) -> Embedding -> attention block -> mean -> Dense: a mask (bool) crosses the cut.

    The attention has no biases: a key bias gets no gradient (softmax ignores it) and Adam would blow its
    rounding noise up to steps of about lr / 1000, unequal between any two summation orders.
    """
    keras.utils.set_random_seed(5)
    tokens = keras.Input((T,), dtype="int32", name="tokens")
    mask = keras.Input((T,), dtype="bool", name="mask")
    attention = keras.layers.Reshape((1, T), name="attention_mask")(mask)
    h = keras.layers.Embedding(VOCAB, 8, name="embed")(tokens)
    a = keras.layers.MultiHeadAttention(2, 4, use_bias=False, name="mha")(h, h, attention_mask=attention)
    h = keras.layers.LayerNormalization(name="ln")(keras.layers.Add(name="add")([h, a]))
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model({"tokens": tokens, "mask": mask}, keras.layers.Dense(3, name="head")(h))


SPLITS = {  # name: (strategy, keyword arguments)
    "model_parallel": (hvd.ModelParallel, {}),
    "model_parallel_always": (hvd.ModelParallel, {"checkpoint": "always"}),
    "pipeline_never": (hvd.Pipeline, {"chunks": CHUNKS, "checkpoint": "never"}),
    "pipeline_except_last": (hvd.Pipeline, {"chunks": CHUNKS, "checkpoint": "except_last"}),
    "pipeline_always": (hvd.Pipeline, {"chunks": CHUNKS, "checkpoint": "always"}),
}
MODELS = {  # name: (make, where to cut, batches)
    "embedding_dense": (make_embedding_model, {"balance": [2, 2]}, lambda: embedding_batches(STEPS, ROWS)),
    "attention": (make_attention_model, {"split_points": ["mha"]}, lambda: encoder_batches(STEPS, ROWS)),
}


def split_of(model, split, cut, dtype="float32"):
    strategy, kwargs = SPLITS[split]
    return strategy(model, devices=DEVICES, dtype=dtype, **cut, **kwargs)


def tape_loop(model, data, loss_fn, mode):
    """3 Adam steps with a GradientTape: eager, eager under ``record()`` (the timed backward) or in a tf.function."""
    optimizer = keras.optimizers.Adam(LR)
    kinds = []

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        kinds.append([type(g).__name__ for g in grads])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    run = tf.function(step) if mode == "function" else step
    for x, y in data:
        if mode == "recorded":
            with model.record() as timeline:
                run(x, y)
            assert {e.kind for e in timeline.events} == {"F", "B"}
        else:
            run(x, y)
    return kinds, model.get_weights()


def assert_weights(got, want, atol=1e-5):
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=f"weight {k}")


def reference(name):
    make, _, data = MODELS[name]
    model = make()
    with tf.GradientTape() as tape:
        x, y = data()[0]
        first = tape.gradient(keras.losses.MeanSquaredError()(y, model(x, training=True)), model.trainable_variables)
    assert isinstance(first[0], tf.IndexedSlices), "plain Keras gives the Embedding an IndexedSlices"
    return one_process(make(), data(), keras.optimizers.Adam(LR), keras.losses.MeanSquaredError(), training=True)[1]


# The timed backward wraps every model alike: the Embedding + Dense model alone runs it.
TAPE_CASES = [(name, split, mode) for name in MODELS for split in SPLITS for mode in ("eager", "recorded", "function")
              if mode != "recorded" or name == "embedding_dense"]


@pytest.mark.parametrize("name,split,mode", TAPE_CASES)
def test_a_tape_loop_keeps_the_embedding_gradient_sparse_and_equals_plain_keras(name, split, mode):
    make, cut, data = MODELS[name]
    kinds, got = tape_loop(split_of(make(), split, cut), data(), keras.losses.MeanSquaredError(), mode)
    assert all(k[0] == "IndexedSlices" for k in kinds), kinds
    assert_weights(got, reference(name))


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", list(MODELS))
def test_fit_equals_plain_keras_under_adam(name, split):
    make, cut, data = MODELS[name]
    batches = data()
    x = {k: np.concatenate([b[0][k] for b in batches]) for k in batches[0][0]} if isinstance(batches[0][0], dict) \
        else np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    model = split_of(make(), split, cut)
    model.compile(optimizer=keras.optimizers.Adam(LR), loss="mse")
    model.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
    assert_weights(model.get_weights(), reference(name))


@pytest.mark.parametrize("split", ["model_parallel", "pipeline_except_last", "pipeline_always"])
def test_a_tied_embedding_under_adam_equals_plain_keras(split):
    """GPT-2's token embedding is read on stage 0 (rows: sparse) and as the head on stage 1 (dense): the sum is
    dense in plain Keras and in the split alike."""
    data = token_batches(STEPS, 4)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
    want = one_process(tied_gpt2(), data, keras.optimizers.Adam(LR), loss, training=True)[1]
    split = split_of(tied_gpt2(), split, {"split_points": ["token_embedding"]}, "float64")
    _, got = tape_loop(split, data, loss, "eager")
    assert_weights(got, want, atol=1e-9)

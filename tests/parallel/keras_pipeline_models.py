"""Seeded Keras models, batches and one-process references shared by the Keras pipeline worker files (mp_tf_*).

Not a worker file itself (no ``mp_`` prefix: test_launchers.py does not launch it); the worker files import
it by name, tests/parallel being on sys.path under pytest's rootdir import. Every model is seeded, so each
rank and the one-process reference build the same weights.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd

T, VOCAB = 6, 30  # the encoder's tokens per row and vocabulary


def mlp(seed=7, features=6, width=16, outputs=3, second="relu"):
    """Dense -> tanh -> Dense -> ``second`` -> Dense (5 layers), seeded initializers, built by keras.Input."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(width, kernel_initializer=init(seed), bias_initializer=keras.initializers.RandomNormal(seed=seed)),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(width, kernel_initializer=init(seed + 1)),
        keras.layers.Activation(second),
        keras.layers.Dense(outputs, kernel_initializer=init(seed + 2)),
    ])


def batches(steps, rows, features=6, outputs=3, seed=11):
    """``steps`` (inputs, targets) pairs of ``rows`` rows, the same on every rank."""
    rng = np.random.RandomState(seed)
    return [(rng.randn(rows, features).astype("float32"), rng.randn(rows, outputs).astype("float32"))
            for _ in range(steps)]


def make_encoder(outputs=3, token_dtype="int32"):
    """(tokens, padding mask) -> embedding -> 2 attention blocks reading one attention mask -> logits."""
    keras.utils.set_random_seed(5)
    tokens = keras.Input((T,), dtype=token_dtype, name="tokens")
    mask = keras.Input((T,), dtype="bool", name="mask")
    attention = keras.layers.Reshape((1, T), name="attention_mask")(mask)
    h = keras.layers.Embedding(VOCAB, 8, name="embed")(tokens)
    for b in range(2):
        a = keras.layers.MultiHeadAttention(2, 4, name=f"b{b}_mha")(h, h, attention_mask=attention)
        h = keras.layers.LayerNormalization(name=f"b{b}_ln")(keras.layers.Add(name=f"b{b}_add")([h, a]))
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model({"tokens": tokens, "mask": mask}, keras.layers.Dense(outputs, name="head")(h))


def make_embedding_model():
    """tokens -> Embedding -> mean over tokens | Dense(tanh) -> Dense: the embedding's rows on stage 0."""
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((T,), dtype="int32"), keras.layers.Embedding(VOCAB, 8),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(8, "tanh"), keras.layers.Dense(3)])


def embedding_batches(steps, rows, outputs=3):
    """(tokens, targets) pairs for ``make_embedding_model``."""
    rng = np.random.RandomState(5)
    return [(rng.randint(0, VOCAB, (rows, T)).astype("int32"), rng.randn(rows, outputs).astype("float32"))
            for _ in range(steps)]


def encoder_batches(steps, rows, outputs=3, token_dtype="int32"):
    """({tokens, mask}, targets) pairs: each row's mask is True on its first 2..T tokens."""
    rng = np.random.RandomState(4)
    out = []
    for _ in range(steps):
        lengths = rng.randint(2, T + 1, size=rows)
        inputs = {"tokens": rng.randint(1, VOCAB, size=(rows, T)).astype(token_dtype),
                  "mask": np.arange(T)[None, :] < lengths[:, None]}
        out.append((inputs, rng.randn(rows, outputs).astype("float32")))
    return out


def one_process(model, data, optimizer, loss_fn=None, training=None):
    """One process trains the whole ``model`` on the batches: its loss at each step and its final weights."""
    loss_fn = loss_fn or keras.losses.MeanSquaredError()
    losses = []
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=training))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(float(loss))
    return losses, model.get_weights()


def stage_feed(pipe, x, y):
    """Inputs are read on the first stage, targets on the last: the other stages pass None."""
    return x if pipe.is_first else None, y if pipe.is_last else None


def replica_feed(pipe, x, y, replicas=2):
    """In a hybrid each replica takes its share of the global batch (arrays or a dict of them), on every stage."""
    rows = len(y) // replicas
    shard = slice(pipe.replica * rows, (pipe.replica + 1) * rows)
    return ({k: v[shard] for k, v in x.items()} if isinstance(x, dict) else x[shard]), y[shard]


def train_pipeline(pipe, optimizer, data, expected_losses, feed=stage_feed, atol=1e-5):
    """Steps ``pipe`` through ``data``; each step's loss must be the one-process loss to ``atol``.

    The check comes after ``apply_gradients``, so a rank whose loss is off still reaches that step's collectives.
    """
    for step, (x, y) in enumerate(data):
        loss = pipe.train_step(*feed(pipe, x, y))
        pipe.apply_gradients(optimizer)
        assert loss == pytest.approx(expected_losses[step], abs=atol), \
            f"rank {hvd.rank()} step {step}: loss {loss}, one process {expected_losses[step]}"


def check_set_weights_and_inference(pipe, other, rows):
    """``pipe`` takes ``other``'s full weight list, gathers it back bitwise and infers as ``other`` (on the last stage)."""
    pipe.set_weights(other.get_weights())
    assert_weights(pipe.gather_weights(), other.get_weights(), "set vs gathered", atol=0)
    x = np.random.RandomState(3).randn(rows, 6).astype("float32")
    out = pipe(x)
    if pipe.is_last:
        np.testing.assert_allclose(out.numpy(), other(x).numpy(), atol=1e-6, rtol=0)
    else:
        assert out is None


def assert_weights(got, want, what="merged vs one process", atol=1e-5):
    """The same number of weights, each within ``atol`` (0: bitwise equal)."""
    assert len(got) == len(want), f"rank {hvd.rank()}: {what}: {len(got)} weights, want {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=f"rank {hvd.rank()}: {what}, weight {i}")


def shared_ends(seed=3):
    """x -> Dense "shared" -> tanh -> Dense "mid" (tanh) -> the same "shared" again (float64): cut at "mid",
    the first and the last stage both read its kernel and bias (a tied weight)."""
    init = keras.initializers.GlorotUniform
    x = keras.Input((6,), name="x", dtype="float64")
    shared = keras.layers.Dense(6, name="shared", kernel_initializer=init(seed), bias_initializer="ones",
                                dtype="float64")
    h = keras.layers.Activation("tanh", dtype="float64")(shared(x))
    h = keras.layers.Dense(6, activation="tanh", name="mid", kernel_initializer=init(seed + 1), dtype="float64")(h)
    return keras.Model(x, shared(h))


def tied_gpt2(seed=0):
    """keras_hub's GPT2CausalLM, tiny, float64, no dropout: its head is the token embedding called in reverse
    (``ReversibleEmbedding``), inside the backbone on stage 0 and as the head on stage 1 when cut at "token_embedding"."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=16, dropout=0.0, dtype="float64")
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def token_batches(steps, rows, seed=5):
    """({token_ids, padding_mask}, next token ids) pairs of ``rows`` rows of ``T`` tokens."""
    rng = np.random.default_rng(seed)
    return [({"token_ids": rng.integers(0, VOCAB, (rows, T)).astype("int32"),
              "padding_mask": np.ones((rows, T), dtype=bool)}, rng.integers(0, VOCAB, (rows, T)).astype("int32"))
            for _ in range(steps)]


def float64_batches(steps, rows, seed=6):
    """(x, y) pairs of ``rows`` rows of 6 float64 features."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((rows, 6)), rng.standard_normal((rows, 6))) for _ in range(steps)]

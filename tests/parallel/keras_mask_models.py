"""Seeded functional Keras models that hand implicit masks (``Embedding(mask_zero=True)``) from layer to layer, and their batches.

Not a worker file (no ``mp_`` prefix): mp_tf_keras_hub.py imports it by its bare name, the one-process
tests as ``tests.parallel.keras_mask_models``. Token id 0 pads, so each row's mask is True on its first
2..T tokens. The weights' dtype is Keras's floatx when the model is built.
"""
import keras
import numpy as np

T, VOCAB = 6, 20


class Scale(keras.layers.Layer):
    """A custom layer with ``supports_masking`` that reads the mask Keras passes it (``mask=``): x * w, padding zeroed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x, mask=None):
        return x * self.w * keras.ops.cast(mask, x.dtype)[..., None]


def recurrent(seed=1):
    """ids -> Embedding(mask_zero) -> Scale -> MultiHeadAttention -> LSTM -> GlobalAveragePooling1D -> Dense.

    Scale, the LSTM and the pooling take ``mask=`` (Keras records it in their calls); the attention reads
    its inputs' masks from the tensors themselves (``_keras_mask``), and so does nothing else here.
    """
    keras.utils.set_random_seed(seed)
    ids = keras.Input((T,), dtype="int32", name="ids")
    h = Scale(name="scale")(keras.layers.Embedding(VOCAB, 8, mask_zero=True, name="embed")(ids))
    h = keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
    h = keras.layers.LSTM(8, return_sequences=True, name="lstm")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(ids, keras.layers.Dense(3, name="head")(h))


def attention(seed=2):
    """ids -> Embedding(mask_zero) -> Dense -> MultiHeadAttention -> Dense per token (its output keeps the mask).

    No layer takes ``mask=``: the mask lives only on the tensors, the attention reads it there, and a
    Keras loss weighs the output's tokens by it.
    """
    keras.utils.set_random_seed(seed)
    ids = keras.Input((T,), dtype="int32", name="ids")
    h = keras.layers.Dense(8, activation="tanh", name="proj")(keras.layers.Embedding(VOCAB, 8, mask_zero=True,
                                                                                      name="embed")(ids))
    h = keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
    return keras.Model(ids, keras.layers.Dense(3, name="tokens")(h))


def sequential(built=True, seed=3):
    """Embedding(mask_zero) -> Dense -> LSTM -> Dense as a keras.Sequential on a keras.Input (or a list of the layers)."""
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Embedding(VOCAB, 8, mask_zero=True, name="embed"), keras.layers.Dense(8, name="proj"),
              keras.layers.LSTM(4, name="lstm"), keras.layers.Dense(3, name="head")]
    return keras.Sequential([keras.Input((T,), dtype="int32"), *layers]) if built else layers


MODELS = {"recurrent": (recurrent, (3,)), "attention": (attention, (T, 3))}


def padded_batches(steps, rows, outputs, seed=4):
    """``steps`` (ids, targets) pairs: ids of tokens 1..VOCAB-1, each row padded with 0 after 2..T tokens."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        lengths = rng.randint(2, T + 1, size=rows)
        ids = rng.randint(1, VOCAB, size=(rows, T)) * (np.arange(T)[None] < lengths[:, None])
        out.append((ids.astype("int32"), rng.randn(rows, *outputs)))
    return out

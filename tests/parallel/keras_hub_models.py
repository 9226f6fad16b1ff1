"""Small keras_hub backbones built from arguments (nothing downloaded) and their dict batches, seeded alike everywhere.

Not a worker file (no ``mp_`` prefix): mp_tf_keras_hub.py imports it by its bare name (tests/parallel is
on sys.path under pytest's rootdir import), tests/tensorflow/test_keras_hub.py as
``tests.parallel.keras_hub_models`` (the repository root is on sys.path). The weights' dtype is Keras's
floatx when the model is built.
"""
import keras
import numpy as np

VOCAB, LENGTH, HIDDEN = 100, 8, 16


def gpt2(layers=4, dropout=0.0, seed=1):
    """``GPT2Backbone``: token and position embeddings, ``layers`` decoder blocks, a final norm."""
    import keras_hub  # a test that needs it skips (or fails) by itself when it is missing

    keras.utils.set_random_seed(seed)
    return keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=layers, num_heads=2, hidden_dim=HIDDEN,
                                         intermediate_dim=2 * HIDDEN, max_sequence_length=16, dropout=dropout)


def bert(layers=3, seed=2):
    """``BertBackbone``: three inputs, ``layers`` encoder blocks, outputs {sequence_output, pooled_output}."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    return keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=layers, num_heads=2, hidden_dim=HIDDEN,
                                         intermediate_dim=2 * HIDDEN, max_sequence_length=16, dropout=0.0)


def tokens(model, rows=6, seed=0):
    """A dict batch of ``model``'s inputs: random token and segment ids, each row padded after 3..LENGTH tokens."""
    rng = np.random.RandomState(seed)
    batch = {"token_ids": rng.randint(0, VOCAB, (rows, LENGTH)),
             "padding_mask": np.arange(LENGTH)[None] < rng.randint(3, LENGTH + 1, rows)[:, None],
             "segment_ids": rng.randint(0, 2, (rows, LENGTH))}
    return {name: batch[name] for name in model.input}

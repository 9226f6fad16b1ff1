"""Data, seeded models and one-process references shared by the Keras data-parallel worker files (mp_tf_dp, mp_tf_shard).

Not a worker file itself (no ``mp_`` prefix: test_launchers.py does not launch it); the worker files import it
by name, tests/parallel being on sys.path under pytest's rootdir import. The worker file calls ``hvd.init``
(with the process sets its tests need); these helpers read the rank and size when called, after it.

Every rank starts from its OWN random weights (seed ``SEED0 + rank``); the reference, computed inside every
rank, is one process training rank 0's initial model on the concatenation of all ranks' batches.
"""
import keras
import numpy as np
import tensorflow as tf

import dualframe.tensorflow.keras as hvd

FEATURES, PER_RANK, STEPS = 6, 4, 6
SEED0 = 100


def data(steps=STEPS, per_rank=PER_RANK, seed=0):
    """Rows for ``steps`` global steps of ``per_rank`` rows on each rank: a noisy tanh of a random projection."""
    rng = np.random.RandomState(seed)
    x = rng.randn(steps * per_rank * hvd.size(), FEATURES).astype("float32")
    y = (np.tanh(x @ rng.randn(FEATURES, 1)) + 0.1 * rng.randn(len(x), 1)).astype("float32")
    return x, y


def rank_rows(array, per_rank=PER_RANK, rank=None):
    """This rank's rows (or ``rank``'s): in global step k it takes the rank-th block of per_rank rows."""
    blocks = array.reshape(-1, hvd.size(), per_rank, *array.shape[1:])
    return blocks[:, hvd.rank() if rank is None else rank].reshape(-1, *array.shape[1:])


def make_model(seed, norm=None, built=True, cls=keras.Sequential):
    """Seeded initializers: the same weights whenever the model gets built (now, or in fit)."""
    keras.utils.set_random_seed(seed)
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((FEATURES,))] if built else []
    layers += [keras.layers.Dense(16, activation="tanh", kernel_initializer=init(seed), bias_initializer="zeros")]
    layers += [norm()] if norm else []
    return cls(layers + [keras.layers.Dense(1, kernel_initializer=init(seed + 1))])


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def assert_equal_on_all_ranks(model):
    gathered = hvd.allgather(tf.constant(flat(model)[None])).numpy()
    for row in gathered[1:]:
        np.testing.assert_array_equal(row, gathered[0])


def one_process_fit(model, optimizer, x, y, batch, epochs=1):
    """The reference: ``model`` fitted in this one process on all the rows, in order, ``batch`` rows a step."""
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model


def rank_fit(model, optimizer, x, y, epochs=1, broadcast=True, run_eagerly=False):
    """``model`` fitted on this rank's rows, PER_RANK a step; with ``broadcast``, rank 0's weights first."""
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    model.fit(rank_rows(x), rank_rows(y), batch_size=PER_RANK, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if broadcast else [])
    return model

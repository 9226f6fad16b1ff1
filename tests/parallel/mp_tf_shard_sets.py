"""Keras ZeRO-3 on 4 ranks (oversubscribed): checkpoints resumed on another number of ranks (4 -> 2, 2 -> 4).

Every rank runs every test; each compares with a one-process reference computed inside the rank. The file
shares the np=4 launch of the Keras pipeline files (test_launchers.SHARED_LAUNCHES): Horovod starts once, in
the first file, with the pairs [0, 1] and [2, 3] among its process sets, and this file's init asks for the same.
"""
# np: 4
# timeout: 400
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow.keras as hvd
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.tensorflow.pipeline.link import process_sets

hvd.init(process_sets=pipeline_process_sets(4, 2))  # [[0, 1], [2, 3], [0, 2], [1, 3]]
TOL = 1e-5


def tiny(seed):
    """Dense -> LayerNormalization -> Dense (6 features in, 1 out), seeded."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.LayerNormalization()(keras.layers.Dense(8, activation="tanh")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def batches(steps=3, rows=8):
    rng = np.random.RandomState(4)
    return [(rng.randn(rows, 6).astype("float32"), rng.randn(rows, 1).astype("float32")) for _ in range(steps)]


def steps(model, optimizer, data, wrt, process_set=None):
    """Eager tape steps, each rank of ``process_set`` on its 1/N of the rows (None: all rows, one process)."""
    n, r = (process_set.size(), process_set.rank()) if process_set is not None else (1, 0)
    for x, y in data:
        rows = slice(r * len(x) // n, (r + 1) * len(x) // n)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[rows], training=True) - y[rows]))
        optimizer.apply(tape.gradient(loss, wrt()), wrt())


def zero3(seed, process_set):
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), shard="parameters", process_set=process_set)
    return optimizer.shard_model(tiny(seed)), optimizer


@pytest.mark.parametrize("saved_on, resumed_on", [(4, 2), (2, 4)])
def test_zero3_checkpoint_resumes_on_another_number_of_ranks(saved_on, resumed_on):
    """Two ZeRO-3 steps on ``saved_on`` ranks (2: each pair alike), the unsharded weights and Adam state loaded by
    ``resumed_on`` ranks into a model of other weights, a third step: both equal one process's."""
    pairs = process_sets([[0, 1], [2, 3]])
    sets = {4: hvd.global_process_set, 2: pairs[(0, 1) if hvd.rank() < 2 else (2, 3)]}
    data = batches()
    model, optimizer = zero3(0, sets[saved_on])
    steps(model, optimizer, data[:2], optimizer.parameter_slices, sets[saved_on])
    weights, state = model.get_weights(), optimizer.state_arrays()  # gathered: the plain layout
    resumed_model, resumed = zero3(5, sets[resumed_on])
    resumed_model.set_weights(weights)
    resumed.load_state_arrays(state)
    steps(resumed_model, resumed, data[2:], resumed.parameter_slices, sets[resumed_on])
    assert resumed.sharded_for() == resumed_on and optimizer.sharded_for() == saved_on
    reference, reference_optimizer = tiny(0), keras.optimizers.Adam(0.05)
    steps(reference, reference_optimizer, data, lambda: reference.trainable_variables)
    for got, expected in zip(resumed_model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, atol=TOL)
    arrays = resumed.state_arrays()
    assert len(arrays) == len(reference_optimizer.variables)
    for got, expected in zip(arrays, reference_optimizer.variables):
        np.testing.assert_allclose(got, np.asarray(expected), atol=TOL)

"""Keras 3 data parallelism on 2 ranks, one per node of the test cluster: equal to one process.

Run by every rank (tests/cluster/test_keras.py starts it with mpirun -H). Each rank starts from its
own weights (seed 100 + rank); the broadcast callback makes them rank 0's; the reference is one
process fitting rank 0's initial model on both ranks' rows, batch by batch.
"""
import socket

import keras
import numpy as np
import tensorflow as tf

import dualframe.tensorflow.keras as hvd
from dualframe.launch.topology import detect

TOPOLOGY = detect()
hvd.init()
SIZE, RANK = hvd.size(), hvd.rank()
FEATURES, PER_RANK, STEPS, SEED0 = 6, 4, 6, 100


def make_model(seed):
    keras.utils.set_random_seed(seed)
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(16, activation="tanh", kernel_initializer=init(seed)),
                             keras.layers.Dense(1, kernel_initializer=init(seed + 1))])


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def test_one_rank_per_node_and_each_knows_it():
    names = hvd.allgather_object(socket.gethostname())
    assert len(set(names)) == SIZE == 2, names
    assert (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (0, 1, RANK, 2)
    assert (TOPOLOGY.local_rank, TOPOLOGY.local_size, TOPOLOGY.cross_rank, TOPOLOGY.cross_size) == (0, 1, RANK, 2)


def test_fit_equals_one_process():
    rng = np.random.RandomState(0)
    x = rng.randn(STEPS * PER_RANK * SIZE, FEATURES).astype("float32")
    y = np.tanh(x @ rng.randn(FEATURES, 1)).astype("float32")
    mine = lambda a: a.reshape(STEPS, SIZE, PER_RANK, -1)[:, RANK].reshape(-1, a.shape[1])  # noqa: E731
    model = make_model(SEED0 + RANK)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    model.fit(mine(x), mine(y), batch_size=PER_RANK, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    reference = make_model(SEED0)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    reference.fit(x, y, batch_size=PER_RANK * SIZE, epochs=2, shuffle=False, verbose=0)
    gathered = hvd.allgather(tf.constant(flat(model)[None])).numpy()
    np.testing.assert_array_equal(gathered[0], gathered[1])
    np.testing.assert_allclose(flat(model), flat(reference), atol=1e-4)

"""Horovod's TF/Keras calls, as Horovod scripts and Horovod's own test files write them, on 2 ranks of dualframe.

The fast subset of Horovod's suite that CI runs (the suite itself is not in the PyPI sdist:
scripts/horovod_tf_suite.sh runs it where a Horovod checkout is at hand): positional calls in Horovod's
order, the Keras module's value collectives, the optimizer wrapper being the user's optimizer class,
``groups``, local variables, TF 1 graph-mode ``broadcast_variables``, and ``BestModelCheckpoint``.
Numbers are checked against what one process computes.
# timeout: 400
"""
import contextlib
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd_tf
import dualframe.tensorflow.keras as hvd
# tests/parallel is on sys.path (pytest rootdir import)
from keras_dp_helpers import PER_RANK, SEED0, assert_equal_on_all_ranks, data, flat, make_model, one_process_fit, \
    rank_fit

hvd.init()
SIZE, RANK = hvd.size(), hvd.rank()


def test_keras_value_collectives_in_horovods_keras_order():
    assert SIZE == 2
    assert float(hvd.allreduce(np.float32(RANK), "mean_rank")) == 0.5
    assert float(hvd.allreduce(np.float32(RANK + 1), "sum_rank", None, 1.0, 1.0, hvd.Sum)) == 3.0
    np.testing.assert_array_equal(hvd.allgather(np.array([[RANK]]), "ranks").numpy(), [[0], [1]])
    np.testing.assert_array_equal(hvd.broadcast(np.array([RANK]), 1, "from_one").numpy(), [1])
    mine = hvd.reducescatter(np.arange(4.0) * (RANK + 1), "scatter", hvd.Sum).numpy()
    np.testing.assert_array_equal(mine, (np.arange(4.0) * 3)[2 * RANK:2 * RANK + 2])


def test_tf_collectives_in_horovods_positional_order():
    assert hvd_tf.broadcast_object({"r": RANK}, 1, None, "obj") == {"r": 1}
    assert hvd_tf.allgather_object(RANK, None, "objs") == [0, 1]
    total = hvd_tf.allreduce(tf.constant([RANK + 1.0]), None, "", "", hvd.Compression.none, hvd.Sum)
    assert float(total[0]) == 3.0
    np.testing.assert_array_equal(hvd_tf.broadcast(tf.constant([RANK]), 0, "b", True).numpy(), [0])
    np.testing.assert_array_equal(hvd_tf.allgather(tf.constant([RANK]), "g", True).numpy(), [0, 1])
    v = tf.Variable([float(RANK)])
    hvd_tf.broadcast_variables([v], 1, hvd_tf.global_process_set, True)
    assert float(v[0]) == 1.0


def test_broadcast_variables_in_tf1_graph_mode_is_horovods_op():
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        v = tf.compat.v1.Variable([float(RANK) + 5.0], use_resource=True)
        op = hvd_tf.broadcast_variables([v], 1)
        session.run(v.initializer)
        session.run(op)
        assert session.run(v)[0] == 6.0


@pytest.mark.parametrize("wrap", ["keras", "tf", "groups=2", "groups=lists", "num_groups=3"])
def test_the_wrapper_is_the_users_optimizer_and_trains_as_one_process(wrap):
    x, y = data(seed=5)
    model = make_model(SEED0 + RANK)
    options = {"groups=2": {"groups": 2}, "groups=lists": {"groups": [model.trainable_variables[:2]]},
               "num_groups=3": {"num_groups": 3}}.get(wrap, {})
    make = hvd_tf.DistributedOptimizer if wrap == "tf" else hvd.DistributedOptimizer
    with pytest.warns(DeprecationWarning) if "num_groups" in options else contextlib.nullcontext():
        optimizer = make(keras.optimizers.SGD(0.1, momentum=0.9), **options)
    assert isinstance(optimizer, keras.optimizers.SGD) and optimizer.momentum == 0.9
    rank_fit(model, optimizer, x, y, epochs=2)
    reference = one_process_fit(make_model(SEED0), keras.optimizers.SGD(0.1, momentum=0.9), x, y, PER_RANK * SIZE, 2)
    assert_equal_on_all_ranks(model)
    np.testing.assert_allclose(flat(model), flat(reference), atol=1e-4)


def test_a_local_variable_keeps_its_own_gradient_divided_by_the_size():
    shared, local = tf.Variable([0.0]), tf.Variable([0.0])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    optimizer.register_local_var(local)
    grad = tf.constant([RANK + 1.0])
    optimizer.apply([grad, grad], [shared, local])
    assert float(shared[0]) == -1.5  # the average of 1 and 2
    assert float(local[0]) == -(RANK + 1.0) / SIZE  # scale_local_gradients=True, as Horovod


def test_gradient_tape_groups_and_generic_names_average_as_one_process():
    w, b = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
    for options in ({}, {"groups": 2}, {"groups": [[b]]}):
        with tf.GradientTape() as tape:
            loss = (RANK + 1.0) * (tf.reduce_sum(w * w) + tf.reduce_sum(b))
        grads = hvd_tf.DistributedGradientTape(tape, **options).gradient(loss, [w, b], None, True)
        np.testing.assert_allclose(grads[0].numpy(), 1.5 * 2 * w.numpy())
        np.testing.assert_allclose(grads[1].numpy(), [1.5])


def test_best_model_checkpoint_is_written_by_rank_0_only(tmp_path_factory):
    folder = hvd_tf.broadcast_object(str(tmp_path_factory.mktemp("best")) if RANK == 0 else None, 0)
    path = os.path.join(folder, f"best_from_rank{RANK}.keras")  # a file of its own per rank: who wrote?
    x, y = data(seed=7)
    model = make_model(SEED0 + RANK)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    best = hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=path)
    model.fit(x[:8], y[:8], batch_size=4, epochs=2, verbose=0, validation_data=(x[8:16], y[8:16]),
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                         best])
    written = hvd_tf.allgather_object(os.path.exists(path))
    assert written == [True, False]

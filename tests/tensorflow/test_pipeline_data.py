"""The batches of a Keras process pipeline's fit, in one process: Keras's cut, the shared shuffle, each replica's share."""
import numpy as np
import pytest
import tensorflow as tf

from dualframe.errors import ChunksError, DataError
from dualframe.tensorflow.pipeline.data import PipelineData, replica_share, split_validation

X = np.arange(20, dtype="float32").reshape(10, 2)
Y = np.arange(10, dtype="float32").reshape(10, 1)


def never(has_batch):
    raise AssertionError("an input of known length needs no agreement")


def test_arrays_are_cut_as_keras_cuts_them_and_checked_before_any_step():
    data = PipelineData(X, Y, 4, None, False, 0, never)
    assert data.num_batches == 3 and data.rows == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([y for _, y in data.epoch(0)]), Y)
    with pytest.raises(ChunksError, match="fit batch 2 of 2 rows gives each of 2 replica.s. 1 rows"):
        data.check(replicas=2, chunks=2, what="fit")


def test_a_shuffle_is_the_same_on_every_rank_and_new_each_epoch():
    first, second = (PipelineData(X, Y, 5, None, True, 7, never) for _ in range(2))
    orders = [[np.concatenate([y for _, y in data.epoch(epoch)]).ravel() for epoch in (0, 1)] for data in (first, second)]
    np.testing.assert_array_equal(orders[0][0], orders[1][0])  # same seed: same order on every rank
    assert sorted(orders[0][0]) == list(Y.ravel()) and not np.array_equal(orders[0][0], orders[0][1])


def test_each_replica_takes_its_equal_share_of_a_global_batch():
    x, y = replica_share((X[:8], Y[:8]), replica=1, replicas=2, chunks=2, what="a batch")
    np.testing.assert_array_equal(y, Y[4:8])
    inputs = {"a": X[:8], "b": X[:8, :1]}
    x, _ = replica_share((inputs, Y[:8]), replica=0, replicas=2, chunks=2, what="a batch")
    np.testing.assert_array_equal(x["b"], X[:4, :1])
    with pytest.raises(DataError, match="a batch of 7 rows does not split evenly among 2"):
        replica_share((X[:7], Y[:7]), replica=0, replicas=2, chunks=2, what="a batch")


def test_an_input_of_unknown_length_asks_every_rank_after_each_batch():
    asked = []
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).filter(lambda *_: True)
    data = PipelineData(dataset, None, None, None, True, 0, lambda has: asked.append(has) or has)
    assert data.num_batches is None and len(list(data.epoch(0))) == 3
    assert asked == [True, True, True, False]


def test_validation_split_takes_the_last_rows_of_arrays_only():
    (x, y), (vx, vy) = split_validation(X, Y, 0.2)
    np.testing.assert_array_equal(vy, Y[8:])
    with pytest.raises(DataError, match="validation_split works on arrays only"):
        split_validation(tf.data.Dataset.from_tensor_slices((X, Y)), None, 0.2)


def test_a_python_generator_is_an_input_of_unknown_length_too():
    asked = []
    batches = (((X[k:k + 5], Y[k:k + 5])) for k in (0, 5))
    data = PipelineData(batches, None, None, None, True, 0, lambda has: asked.append(has) or has)
    got = [y for _, y in data.epoch(0)]
    np.testing.assert_array_equal(np.concatenate(got), Y)
    assert asked == [True, True, False]

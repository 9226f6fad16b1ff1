"""dualframe.tensorflow in one process: tape, SyncBatchNormalization, shard, collectives' checks (size 1)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import keras
import tensorflow as tf

import dualframe
import dualframe.tensorflow as hvd

hvd.init()


def test_tape_gradients_equal_plain_gradients_and_keep_structure():
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    x = tf.random.stateless_normal((5, 4), seed=(1, 2))
    with tf.GradientTape() as plain:
        loss = tf.reduce_sum(layer(x) ** 2)
    expected = plain.gradient(loss, layer.trainable_variables)
    with hvd.DistributedGradientTape(tf.GradientTape(), compression=hvd.Compression.fp16) as tape:
        loss = tf.reduce_sum(layer(x) ** 2)
    got = tape.gradient(loss, {"kernel": layer.kernel, "bias": [layer.bias]})
    np.testing.assert_allclose(got["kernel"], expected[0], rtol=1e-6)
    np.testing.assert_allclose(got["bias"][0], expected[1], rtol=1e-6)


class RecordingTape(tf.GradientTape):
    """A user's own tape class (Horovod's wrapper is an instance of it)."""


def test_the_tape_is_an_instance_of_tf_gradient_tape_and_of_the_wrapped_tapes_class():
    variable = tf.Variable([1.0, 2.0])
    with tf.GradientTape(persistent=True) as plain:
        y = variable * variable
    tape = hvd.DistributedGradientTape(plain)
    assert isinstance(tape, tf.GradientTape) and type(tape).__name__ == "DistributedGradientTape"
    assert tape._persistent and not isinstance(tape, RecordingTape)
    np.testing.assert_allclose(tape.gradient(y, variable), [2.0, 4.0])
    np.testing.assert_allclose(tape.jacobian(y, variable), [[2.0, 0.0], [0.0, 4.0]])  # the wrapped tape's, local
    with hvd.PartialDistributedGradientTape(RecordingTape()) as own:
        y = tf.reduce_sum(3.0 * variable)
    assert isinstance(own, RecordingTape) and isinstance(own, hvd.DistributedGradientTape)
    assert type(own) is type(hvd.DistributedGradientTape(RecordingTape()))  # one class per tape class
    np.testing.assert_allclose(own.gradient(y, [variable])[0], [3.0, 3.0])


def test_tape_argument_checks():
    with pytest.raises(dualframe.StrategyError, match="already a DistributedGradientTape"):
        hvd.DistributedGradientTape(hvd.DistributedGradientTape(tf.GradientTape()))
    with pytest.raises(TypeError, match="wraps a tf.GradientTape"):
        hvd.DistributedGradientTape("tape")
    with pytest.raises(dualframe.StrategyError, match="unknown op"):
        hvd.DistributedGradientTape(tf.GradientTape(), op=17)
    with pytest.raises(TypeError, match="local_layers must be Keras layers"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=["dense"])


@pytest.mark.parametrize("axis, mask", [(1, False), (-1, True)])
def test_sync_batch_norm_moments_equal_keras_moments(axis, mask):
    layer = hvd.SyncBatchNormalization(axis=axis, fused=True)  # Horovod's argument, removed in Keras 3
    shape = (6, 3, 2) if axis == 1 else (6, 2, 3)
    x = tf.random.stateless_normal(shape, seed=(3, 4)) * 3.0 + 5.0
    layer.build(x.shape)
    layer.moving_mean.assign([4.0, 5.0, 6.0])
    weights = np.array([[1, 1], [1, 0], [0, 1], [1, 1], [1, 1], [0, 0]], "float32")  # (batch, time)
    mean, variance = layer._global_moments(x, tf.constant(weights) if mask else None)
    xs = np.moveaxis(x.numpy(), axis, -1).reshape(-1, 3)
    w = weights.reshape(-1, 1) if mask else np.ones((len(xs), 1), "float32")
    expected_mean = (xs * w).sum(0) / w.sum()
    expected_var = (((xs - expected_mean) ** 2) * w).sum(0) / w.sum()
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-5)
    np.testing.assert_allclose(variance, expected_var, rtol=1e-4)


def test_sync_batch_norm_is_batch_norm_with_one_process_and_serializes():
    x = tf.random.stateless_normal((8, 4), seed=(5, 6))
    sync, plain = hvd.SyncBatchNormalization(momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)
    np.testing.assert_allclose(sync(x, training=True), plain(x, training=True), atol=1e-6)
    np.testing.assert_allclose(sync.moving_variance, plain.moving_variance, atol=1e-6)
    again = keras.layers.deserialize(keras.layers.serialize(sync))
    assert isinstance(again, hvd.SyncBatchNormalization) and again.momentum == 0.5
    with pytest.raises(ValueError, match="renorm"):
        hvd.SyncBatchNormalization(renorm=True)


def test_shard_one_process_and_checks():
    assert list(hvd.shard(tf.data.Dataset.range(5)).as_numpy_iterator()) == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        hvd.shard([1, 2, 3])


def test_collective_argument_checks():
    with pytest.raises(dualframe.StrategyError, match=r"root_rank must be an int in \[0, 1\)"):
        hvd.broadcast(tf.ones(2), root_rank=1)
    with pytest.raises(dualframe.StrategyError, match="unknown compression"):
        hvd.allreduce(tf.ones(2), compression="zip")
    np.testing.assert_allclose(hvd.allreduce(np.ones(3, "float32"), op="sum", compression="fp16"), np.ones(3))
    assert hvd.allgather_object("x") == ["x"]


def test_use_before_init_is_refused_with_the_fix():
    code = textwrap.dedent("""
        import keras, tensorflow as tf
        import dualframe.tensorflow.keras as hvd
        for call in (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD()),
                     lambda: hvd.DistributedGradientTape(tf.GradientTape()),
                     lambda: hvd.broadcast_variables([], 0), lambda: hvd.shard(tf.data.Dataset.range(2)),
                     lambda: hvd.allreduce(tf.ones(1)), lambda: hvd.rank()):
            try:
                call()
                print("NO ERROR")
            except Exception as error:  # the type is checked below
                print(type(error).__name__, error)
    """)
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    lines = output.strip().splitlines()
    assert len(lines) == 6, output
    for line in lines:
        assert line.startswith("NotInitializedError") and "init() first" in line, line


def test_horovods_own_tf_functions_are_there_and_work_in_one_process():
    # Horovod's test_tensorflow.py calls these on hvd; they are Horovod's, unchanged (they work on Keras 3).
    import horovod.tensorflow as horovod_tf
    for name in ("grouped_allgather", "grouped_reducescatter", "broadcast_", "broadcast_object_fn", "rank_op",
                 "local_rank_op", "size_op", "local_size_op", "process_set_included_op", "ccl_built"):
        assert getattr(hvd, name) is getattr(horovod_tf, name)
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    gathered, scattered = hvd.grouped_allgather([x]), hvd.grouped_reducescatter([x], op=hvd.Sum)
    np.testing.assert_array_equal(gathered[0].numpy(), x.numpy())
    np.testing.assert_array_equal(scattered[0].numpy(), x.numpy())
    variable = tf.Variable([5.0])
    hvd.broadcast_([variable], root_rank=0)
    assert variable.numpy().tolist() == [5.0]
    assert (int(hvd.rank_op()), int(hvd.size_op()), int(hvd.local_size_op())) == (0, 1, 1)




def test_init_passes_horovods_process_set_objects_on_as_they_are(monkeypatch):
    # Horovod's test_tensorflow_process_sets.py: hvd.init(process_sets=[even_set, odd_set]), then reads
    # even_set.process_set_id, which Horovod's init assigns: the objects must reach it unchanged.
    # (A real second set needs two ranks: the suite run in docs/keras_data_parallel.md does that.)
    collectives = sys.modules["dualframe.tensorflow.collectives"]  # the module (the package exports an instance)
    seen = []
    monkeypatch.setattr(collectives.hvd, "is_initialized", lambda: False)
    monkeypatch.setattr(collectives.hvd, "init", lambda **kwargs: seen.append(kwargs))
    even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[even, odd])
    hvd.init(process_sets=[[0, 1], (2, 3)])
    hvd.init(process_sets="dynamic")
    assert seen[0]["process_sets"][0] is even and seen[0]["process_sets"][1] is odd
    assert [s.ranks for s in seen[1]["process_sets"]] == [[0, 1], [2, 3]]
    assert seen[2] == {"process_sets": "dynamic"}

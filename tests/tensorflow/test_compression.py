"""dualframe.tensorflow.dp.compression in one process: Horovod's Compression.none/fp16 over the core's compressors."""
import horovod.tensorflow as horovod_tf
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
import dualframe.tensorflow.keras as hvd_keras
from dualframe.dp.compression import FP16Compressor, NoneCompressor
from dualframe.tensorflow.dp.compression import Compression
from dualframe.tensorflow.dp.gradients import ReduceSettings

hvd.init()

VALUES = [1.0, 1e-4, 3.14159, -2.5e3, 6.1e4]


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_fp16_round_trip_restores_the_dtype_and_the_numbers_within_fp16_tolerance(dtype):
    grad = tf.constant(VALUES, dtype=dtype)
    sent, ctx = Compression.fp16.compress(grad)
    assert sent.dtype == tf.float16 and ctx == dtype.name
    back = Compression.fp16.decompress(sent, ctx)
    assert back.dtype == dtype
    # float16 keeps 11 significant bits: relative error at most 2 ** -11.
    np.testing.assert_allclose(back.numpy(), VALUES, rtol=2 ** -11)
    # The same numbers as Horovod's own fp16 compressor gives.
    theirs, their_ctx = horovod_tf.Compression.fp16.compress(grad)
    np.testing.assert_array_equal(back.numpy(), horovod_tf.Compression.fp16.decompress(theirs, their_ctx).numpy())


def test_fp16_leaves_integers_and_none_leaves_everything_as_it_is():
    steps = tf.constant([1, 2, 70000], dtype=tf.int32)
    sent, ctx = Compression.fp16.compress(steps)
    assert sent is steps and ctx is None and Compression.fp16.decompress(sent, ctx) is steps
    grad = tf.constant(VALUES)
    assert Compression.none.compress(grad) == (grad, None) and Compression.none.decompress(grad, None) is grad


def test_one_namespace_for_the_api_the_tape_and_the_optimizer():
    assert isinstance(Compression.fp16, FP16Compressor) and isinstance(Compression.none, NoneCompressor)
    assert hvd.Compression is Compression and hvd_keras.Compression is Compression
    assert ReduceSettings.build("test", compression="fp16").compression is Compression.fp16
    assert ReduceSettings.build("test", compression=hvd.Compression.none).compression is Compression.none


def test_allreduce_with_fp16_equals_the_fp16_rounded_reference():
    x = tf.constant(VALUES, dtype=tf.float32)
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert got.dtype == tf.float32
    # One process: the sum is the tensor itself, sent as float16 and cast back.
    np.testing.assert_array_equal(got.numpy(), tf.cast(tf.cast(x, tf.float16), tf.float32).numpy())
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.none).numpy(), x.numpy())

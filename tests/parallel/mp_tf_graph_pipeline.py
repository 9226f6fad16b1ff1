"""TensorFlow DistributedPipeline of a functional model on 3 processes (one stage each): values go straight to their readers.

The twin of mp_torch_graph_pipeline.py. The model takes {x, mask (bool)}; the stem's output skips stage 1
to the head on stage 2 (edge 0 -> 2), the mask goes from stage 0 to stage 1 only, and stage 1 makes one of
the two outputs (edge 1 -> 2 carries it to the loss beside the hidden states). Training must equal one
process training the whole model on the same batches.
"""
# np: 3
# timeout: 400
import keras
import numpy as np
import pytest
import tensorflow as tf

import dualframe.tensorflow as hvd
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
# tests/parallel is on sys.path (pytest rootdir import)
from keras_pipeline_models import assert_weights, one_process, train_pipeline

STEPS, BATCH, CHUNKS = 3, 10, 4
# The neighbour pairs, plus every skip pair (graph=True): stage 0 sends to stage 2 directly.
hvd.init(process_sets=pipeline_process_sets(3, 3, graph=True))
BALANCE = [3, 4, 1]  # x, stem, b1 | mask, b1_mask, b2, aux | head (model.layers in execution order)
SPLIT_POINTS = ["mask", "head"]  # the same cut, by the names where stages 1 and 2 begin


class Head(keras.layers.Layer):
    """Reads the block's output and the stem's (a skip over stage 1)."""

    def __init__(self, units, seed, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, kernel_initializer=keras.initializers.GlorotUniform(seed))

    def call(self, h, skip):
        return self.dense(h + skip)


def make_model(seed=7):
    init = keras.initializers.GlorotUniform
    x = keras.Input((4,), name="x")
    mask = keras.Input((1,), dtype="bool", name="mask")
    h0 = keras.layers.Dense(6, activation="tanh", kernel_initializer=init(seed), name="stem")(x)
    b1 = keras.layers.Dense(6, activation="tanh", kernel_initializer=init(seed + 1), name="b1")(h0)
    h1 = keras.layers.Lambda(lambda a: a[0] * keras.ops.cast(a[1], "float32"), name="b1_mask")([b1, mask])
    b2 = keras.layers.Dense(6, activation="tanh", kernel_initializer=init(seed + 2), name="b2")(h1)
    aux = keras.layers.Lambda(lambda h: keras.ops.sum(h, axis=-1, keepdims=True), name="aux")(h1)
    return keras.Model({"x": x, "mask": mask}, [aux, Head(3, seed + 3, name="head")(b2, h0)])


def loss_fn(y, outputs):
    aux, out = outputs
    return tf.reduce_mean(tf.square(y - out)) + 0.1 * tf.reduce_mean(tf.square(aux))


def batches():
    rng = np.random.RandomState(11)
    return [({"x": rng.randn(BATCH, 4).astype("float32"), "mask": rng.rand(BATCH, 1) > 0.3},
             rng.randn(BATCH, 3).astype("float32")) for _ in range(STEPS)]


def test_edges_skip_the_stage_that_does_not_read():
    pipe = DistributedPipeline(make_model(), BALANCE, chunks=2, loss_fn=loss_fn)
    edges = {0: ((), (1, 2)), 1: ((0,), (2,)), 2: ((0, 1), ())}[pipe.stage_index]
    assert (pipe.role.edges.sources, pipe.role.edges.targets) == edges
    named = DistributedPipeline(make_model(), chunks=2, loss_fn=loss_fn, split_points=SPLIT_POINTS)
    assert named.split.starts == pipe.split.starts
    assert DistributedPipeline(make_model(), chunks=2, loss_fn=loss_fn, stages=3).split.stages == 3


@pytest.mark.parametrize("schedule, cut", [("gpipe", {"balance": BALANCE}), ("1f1b", {"split_points": SPLIT_POINTS}),
                                           ("zb-h1", {"split_points": SPLIT_POINTS})])
def test_training_equals_one_process(schedule, cut):
    data = batches()
    expected_losses, expected_weights = one_process(make_model(), data, keras.optimizers.SGD(0.1, momentum=0.9),
                                                    loss_fn)
    pipe = DistributedPipeline(make_model(), chunks=CHUNKS, schedule=schedule, loss_fn=loss_fn, **cut)
    train_pipeline(pipe, keras.optimizers.SGD(0.1, momentum=0.9), data, expected_losses)
    assert_weights(pipe.gather_weights(), expected_weights)


def test_inference_returns_the_model_outputs_on_the_last_stage():
    model = make_model()
    pipe = DistributedPipeline(make_model(), BALANCE, chunks=3, loss_fn=loss_fn)
    x, _ = batches()[0]
    out = pipe(x)
    if pipe.is_last:
        assert len(out) == 2
        for got, want in zip(out, model(x)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)
    else:
        assert out is None

"""A rank's several Keras stages (virtual stages) in one process: every stage's work of a 2-rank schedule walked in
the clock table's order, the edges between one rank's stages handed over in memory, against one tape."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from dualframe.pipeline.schedule import rank_schedule, stage_placement
from dualframe.tensorflow.graph.capture import capture
from dualframe.tensorflow.pipeline.compiled import GraphStageFunction
from dualframe.tensorflow.pipeline.graph import process_stages
from dualframe.tensorflow.pipeline.graph_work import TFGraphStageWork
from dualframe.testing.one_process import walk_in_one_process

SIZES = [3, 3, 2, 2]  # 10 rows in 4 micro-batches


def model():
    init = keras.initializers.GlorotUniform
    layers = [keras.layers.Dense(6, "tanh", kernel_initializer=init(k)) for k in range(3)] + [
        keras.layers.Dense(3, kernel_initializer=init(3))]
    return keras.Sequential([keras.Input((5,))] + layers)


def recorded(method, sent):
    """``method`` (a work's forward or backward) appending what it returns to ``sent``."""
    def call(i, messages):
        out = method(i, messages)
        sent.append(out)
        return out
    return call


def walk(net, schedule, x, y):
    """One step of ``schedule`` (2 ranks x 2 stages, a Dense layer each): the loss, the variables' gradients, the sent."""
    captured, loss = capture(net), keras.losses.MeanSquaredError()
    split, stages = process_stages(captured, balance=[1, 1, 1, 1])
    placement = stage_placement(schedule, 2, 2)
    xs, ys = tf.split(x, SIZES), tf.split(y, SIZES)
    works = [TFGraphStageWork(stages[j], split, j, captured, loss, ys if j == 3 else [], [s / 10 for s in SIZES],
                              "/CPU:0", GraphStageFunction(stages[j], split, j, captured, loss),
                              split_backward=schedule == "zb-v",
                              local=[k for k in range(4) if placement[k] == placement[j]]) for j in range(4)]
    sent = []  # what each F and B sends: a packed message, or the tensors handed over on one rank
    for work in works:
        for name in ("forward", "backward"):
            setattr(work, name, recorded(getattr(work, name), sent))
    walk_in_one_process(rank_schedule(schedule, 2, len(SIZES), virtual_stages=2), split, dict(enumerate(works)),
                        [{split.graph.inputs[0]: t} for t in xs])
    kinds = {type(m).__name__ for messages in sent for m in messages.values()}
    gradients = [g for j in range(4) for g in works[j].step_gradients()]
    return works[3].loss_sum, gradients, kinds


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_virtual_stages_equal_one_tape_with_a_rank_s_stages_handed_over_in_memory(schedule):
    rng = np.random.RandomState(3)
    x, y = tf.constant(rng.randn(10, 5).astype("float32")), tf.constant(rng.randn(10, 3).astype("float32"))
    net = model()
    with tf.GradientTape() as tape:
        want_loss = keras.losses.MeanSquaredError()(y, net(x, training=True))
    want = tape.gradient(want_loss, net.trainable_weights)
    for _ in range(2):  # the compiled passes traced, then again
        loss, gradients, kinds = walk(net, schedule, x, y)
        assert loss == pytest.approx(float(want_loss), abs=1e-5)
        for got, expected in zip(gradients, want):
            np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5, rtol=0)
    # zb-v's turn (stage 1 -> 2 on one rank) hands the tensors over: a list, beside packed byte messages (host arrays)
    assert kinds == ({"list", "ndarray"} if schedule == "zb-v" else {"ndarray"})

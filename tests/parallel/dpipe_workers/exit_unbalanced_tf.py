"""Keras twin of exit_unbalanced.py: 2-process pipelines trained, then the script simply ends, one stage first.

Started by tests/parallel/test_dpipe_exit.py under each launcher; not a pytest module. DPIPE_FIRST=last
makes the last stage of the second (kept) pipeline light, =first the first stage; the first pipeline,
balanced the other way, is dropped after training. Each step's loss is compared with one process training
the same model. No barrier and no collective at the end.
"""
import keras
import numpy as np
import tensorflow as tf

import dualframe.tensorflow as hvd
from exit_order import check_losses, train_then_leave

hvd.init()
LAYERS, WIDTH, ROWS, STEPS = 12, 512, 256, 3  # the heavy stage computes ~0.1 s a step on one thread


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH) for _ in range(LAYERS)])


def batches():
    rng = np.random.RandomState(1)
    return rng.randn(ROWS, WIDTH).astype("float32"), rng.randn(ROWS, WIDTH).astype("float32")


def one_process_losses():
    whole, (x, y) = model(), batches()
    optimizer, losses = keras.optimizers.SGD(0.05), []
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, whole(x))
        optimizer.apply_gradients(zip(tape.gradient(loss, whole.trainable_variables), whole.trainable_variables))
        losses.append(float(loss))
    return losses


def train(balance, expected):
    pipe = hvd.DistributedPipeline(model(), balance, chunks=4, loss_fn="mse", jit_compile=False)
    optimizer, (x, y) = keras.optimizers.SGD(0.05), batches()
    losses = []
    for _ in range(STEPS):
        losses.append(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None))
        pipe.apply_gradients(optimizer)
    check_losses(losses, expected, 1e-4, hvd.rank(), balance)
    return pipe


expected = one_process_losses()  # before training: the light rank must leave right after its last step
train_then_leave(lambda balance: train(balance, expected), LAYERS, hvd.rank())

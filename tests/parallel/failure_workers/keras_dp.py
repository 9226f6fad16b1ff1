"""Keras data parallelism: a rank failing mid-fit ends the job; 10 steps straight == 5 + the job killed + 5 resumed.

``--phase crash``: train 2 epochs of 5 steps straight (weights kept in ``straight.npz``), then start
again from the same seeds with ``hvd.CheckpointCallback`` saving each epoch; in epoch 1, at batch 2,
rank 1 raises (``--fault raise``) or is SIGKILLed (``--fault kill``).
``--phase resume``: load the newest checkpoint (end of epoch 0), fit epoch 1, compare with ``straight.npz``.
Dropout (a seed generator among the model's variables), per-epoch data drawn from each rank's own
numpy stream and TensorFlow global generator, SGD momentum and the optimizer's iteration count make every part of the state matter.
"""
import argparse
import os
import signal
import time

import keras
import numpy as np
import tensorflow as tf

import dualframe.tensorflow.keras as hvd

EPOCHS, STEPS, BATCH = 2, 5, 4


class Fault(keras.callbacks.Callback):
    def __init__(self, fault):
        super().__init__()
        self.fault, self.epoch = fault, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.fault and self.epoch == 1 and batch == 2 and hvd.rank() == 1:
            print(f"dualframe-test: fault {self.fault} at {time.time():.3f}", flush=True)
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected fault")


def fresh(seed):
    keras.utils.set_random_seed(seed + hvd.rank())  # ranks start apart; the broadcast makes them equal
    tf.random.get_global_generator().reset_from_seed(seed + hvd.rank())
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    return model


def train(model, start, callbacks):
    for epoch in range(start, EPOCHS):
        # This rank's data for the epoch, from its numpy stream and TensorFlow's global generator.
        x = np.random.randn(STEPS * BATCH, 6).astype("float32") + tf.random.get_global_generator().normal(
            [STEPS * BATCH, 6]).numpy()
        model.fit(x, x.sum(1, keepdims=True), batch_size=BATCH, epochs=epoch + 1, initial_epoch=epoch,
                  shuffle=False, verbose=0, callbacks=callbacks)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("crash", "resume"), required=True)
    parser.add_argument("--fault", choices=("raise", "kill"), default="kill")
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    hvd.init()
    straight, ckpt = os.path.join(args.dir, "straight.npz"), os.path.join(args.dir, "ckpt")
    broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    if args.phase == "crash":
        model = fresh(1234)
        np.random.seed(100 + hvd.rank())
        train(model, 0, [broadcast])
        if hvd.rank() == 0:
            np.savez(straight, *model.get_weights())
        model = fresh(1234)
        np.random.seed(100 + hvd.rank())
        broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
        train(model, 0, [broadcast, hvd.CheckpointCallback(ckpt, keep=2), Fault(args.fault)])
        raise AssertionError("rank 1 should have failed")
    model = fresh(777)  # other weights and streams: the checkpoint must restore them
    np.random.seed(999)
    state = hvd.load_checkpoint(ckpt, model)
    assert state is not None and state.epoch == 1 and state.step == STEPS, state
    train(model, state.epoch, [broadcast])
    if hvd.rank() == 0:
        expected = np.load(straight)
        for i, value in enumerate(model.get_weights()):
            error = np.abs(value - expected[f"arr_{i}"]).max()
            assert error < 1e-6, f"weight {i} differs from the straight run by {error}"
        print(f"dualframe-test: resumed run equals the straight run ({len(expected.files)} arrays)", flush=True)
    hvd.barrier()


if __name__ == "__main__":
    main()

"""Elastic Keras data parallelism: a worker SIGKILLed mid-epoch, the survivor restores the last commit and finishes.

Started by tests/parallel/test_failures.py like torch_elastic.py. Two epochs of 6 batches, a
commit every 2 batches; rank 1 kills itself before epoch 1's batch 3, so the survivor goes back to
the commit after epoch 1's batch 2, trains the rest of the epoch alone (its data from state.batch
on), and must equal a one-process reference that trains on both ranks' batches up to that commit
and on rank 0's alone after it (SGD with momentum: the optimizer's slots roll back too).
"""
import os
import signal
import time

import keras
import numpy as np

import dualframe.tensorflow.keras as hvd
from dualframe.tensorflow.keras import elastic

EPOCHS, BATCHES, BATCH, COMMIT_EVERY = 2, 6, 4, 2
KILL_AT = (1, 3)  # (epoch, batch)


def data(epoch, rank, start=0):
    x = np.random.RandomState(100 * epoch + rank).randn(BATCHES * BATCH, 6).astype("float32")
    return x[start * BATCH:], x[start * BATCH:].sum(1, keepdims=True)


def fresh(distributed):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer) if distributed else optimizer, loss="mse")
    return model


class Kill(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_begin(self, batch, logs=None):
        if (self.state.epoch, self.state.batch) == KILL_AT and hvd.size() == 2 and hvd.rank() == 1:
            print(f"dualframe-test: fault kill at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def reference():
    model = fresh(distributed=False)
    commit = KILL_AT[0] * BATCHES + COMMIT_EVERY * (KILL_AT[1] // COMMIT_EVERY)
    for epoch in range(EPOCHS):
        parts = [data(epoch, r) for r in (0, 1)]
        for batch in range(BATCHES):
            rows = slice(batch * BATCH, (batch + 1) * BATCH)
            ranks = (0, 1) if epoch * BATCHES + batch < commit else (0,)
            model.train_on_batch(np.concatenate([parts[r][0][rows] for r in ranks]),
                                 np.concatenate([parts[r][1][rows] for r in ranks]))
    return model


def main():
    hvd.init()
    model = fresh(distributed=True)
    state = elastic.KerasState(model, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: print(f"dualframe-test: reset, now {hvd.size()} worker(s)", flush=True)])
    callbacks = [Kill(state), elastic.UpdateBatchStateCallback(state), elastic.UpdateEpochStateCallback(state),
                 elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY)]

    @elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            x, y = data(state.epoch, hvd.rank(), start=state.batch)
            model.fit(x, y, batch_size=BATCH, initial_epoch=state.epoch, epochs=state.epoch + 1, shuffle=False,
                      verbose=0, callbacks=callbacks)

    train(state)
    for i, (got, want) in enumerate(zip(model.get_weights(), reference().get_weights())):
        error = np.abs(got - want).max()
        assert error < 1e-5, f"weight {i} differs from the reference by {error}"
    print(f"dualframe-test: elastic run finished {EPOCHS} epochs on {hvd.size()} worker(s), equal to the reference",
          flush=True)


if __name__ == "__main__":
    main()

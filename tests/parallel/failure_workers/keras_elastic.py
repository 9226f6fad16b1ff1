"""Elastic Keras data parallelism: a worker SIGKILLed mid-epoch, the survivor restores the last commit and finishes.

Started by tests/parallel/test_failures.py like torch_elastic.py. Two epochs of 6 batches, a
commit every 2 batches; rank 1 kills itself before epoch 1's batch 3, so the survivor goes back to
the commit after epoch 1's batch 2, trains the rest of the epoch alone (its data from state.batch
on), and must equal a one-process reference that trains on both ranks' batches up to that commit
and on rank 0's alone after it (SGD with momentum: the optimizer's slots roll back too).

``--grow MARKER``: started on one worker, like torch_elastic.py's mode. Each step trains on one
global batch of ``GLOBAL`` rows split over the current workers (by sample weights, see ``shard``); after the commit of epoch 0's batch
``COMMIT_EVERY`` the worker writes MARKER and waits (committing) for a second worker. The reset
must re-trace ``fit``'s step (traced on one worker it has no allreduce); both workers must equal a
one-process reference on the whole batches, and each other.
"""
import argparse
import os
import pathlib
import signal
import time

import keras
import numpy as np

import dualframe.tensorflow.keras as hvd
from dualframe.tensorflow.keras import elastic

EPOCHS, BATCHES, BATCH, COMMIT_EVERY = 2, 6, 4, 2
KILL_AT = (1, 3)  # (epoch, batch)
GLOBAL, GROW_WAIT_S = 8, 150.0


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


def global_data(epoch, start=0):
    """The epoch's global batches from ``start`` on: (batches, GLOBAL, 6) inputs and their targets."""
    x = np.random.RandomState(500 + epoch).randn(BATCHES, GLOBAL, 6).astype("float32")[start:]
    return x, x.sum(2, keepdims=True)


def shard(epoch, start):
    """Every global batch, each row weighted ``size`` if it is this worker's share, else 0.

    Averaged over the workers that is the whole batch's loss on any number of workers, and every
    step has the same shape on 1 and on 2 workers, so ``fit`` would reuse a step traced before the
    reset (on 1 worker: no allreduce in it) unless the reset drops it.
    """
    x, y = global_data(epoch, start)
    rows = GLOBAL // hvd.size()
    weights = np.zeros(x.shape[:2], "float32")
    weights[:, hvd.rank() * rows:(hvd.rank() + 1) * rows] = hvd.size()
    return x.reshape(-1, 6), y.reshape(-1, 1), weights.reshape(-1)


def grow_reference():
    model = fresh(distributed=False)
    for epoch in range(EPOCHS):
        for x, y in zip(*global_data(epoch)):
            model.train_on_batch(x, y)
    return model


class WaitForASecondWorker(keras.callbacks.Callback):
    """After the commit of epoch 0's batch COMMIT_EVERY on one worker: write the marker, commit until a reset."""

    def __init__(self, state, marker):
        super().__init__()
        self.state, self.marker = state, marker

    def on_train_batch_end(self, batch, logs=None):
        if (self.state.epoch, self.state.batch) != (0, COMMIT_EVERY) or hvd.size() != 1:
            return
        self.marker.write_text("committed\n")
        print(f"dualframe-test: wrote {self.marker.name} after batch {self.state.batch}, waiting for a worker",
              flush=True)
        deadline = time.monotonic() + GROW_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.2)
            self.state.commit()  # raises HostsUpdatedInterrupt once the driver reports the new host
        raise SystemExit(f"no second worker joined within {GROW_WAIT_S} s of {self.marker}")


def grow(marker):
    hvd.init()
    model = fresh(distributed=True)
    state = elastic.KerasState(model, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: print(f"dualframe-test: reset, now {hvd.size()} worker(s)", flush=True)])
    callbacks = [elastic.UpdateBatchStateCallback(state), elastic.UpdateEpochStateCallback(state),
                 elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY),
                 WaitForASecondWorker(state, marker)]

    @elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            x, y, weights = shard(state.epoch, state.batch)
            model.fit(x, y, sample_weight=weights, batch_size=GLOBAL, initial_epoch=state.epoch,
                      epochs=state.epoch + 1, shuffle=False, verbose=0, callbacks=callbacks)

    train(state)
    assert hvd.size() == 2, f"the job ended on {hvd.size()} worker(s), it never grew"
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    gathered = hvd.allgather(flat[None]).numpy()
    assert np.array_equal(gathered[0], gathered[1]), f"the workers differ by {np.abs(gathered[0] - gathered[1]).max()}"
    for i, (got, want) in enumerate(zip(model.get_weights(), grow_reference().get_weights())):
        error = np.abs(got - want).max()
        assert error <= 1e-4, f"weight {i} differs from the one-process reference by {error}"
    print(f"dualframe-test: grown run finished {EPOCHS} epochs on {hvd.size()} workers, rank {hvd.rank()} equal to "
          f"the reference and to the other worker", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grow", type=pathlib.Path, help="marker file the discovery script waits for")
    args = parser.parse_args()
    if args.grow:
        return grow(args.grow)
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

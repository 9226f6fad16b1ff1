"""Keras data parallelism whose ranks disagree on a collective in the middle of ``fit``: the job must end, not hang.

Started by tests/parallel/test_failures.py with ``DUALFRAME_STALL_TIMEOUT=10``. At batch 2, from a callback:

* ``--fault name``: rank 1 calls an allreduce named ``other name`` while rank 0 runs the train step
  (its gradient allreduce, inside the graph): both wait forever without dualframe's stall watchdog.
* ``--fault early``: rank 1 leaves ``fit`` (``stop_training``) and calls ``hvd.barrier()`` while rank 0
  still trains.
* ``--fault loop``: a custom loop whose ``tf.function`` step (DistributedGradientTape) runs under
  ``hvd.stall_guard``; rank 1 stops calling collectives (sleeps), rank 0's guarded step waits for it.
* ``--fault mismatch``: both ranks call an allreduce named ``mismatch``; first with different dtypes
  (the error is caught and printed: Horovod goes on working), then with different shapes (not
  caught: the failure hook names the rank and Horovod's error, and the job ends).
"""
import argparse
import time

import keras
import numpy as np
import horovod.tensorflow as horovod_tf
import tensorflow as tf

import dualframe.tensorflow.keras as hvd


def first_line(error):
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def mismatch():
    wide = hvd.rank() == 1
    try:
        hvd.allreduce(tf.ones(3, dtype=tf.float64 if wide else tf.float32), name="mismatch")
        print("dualframe-test: the dtype mismatch raised nothing", flush=True)
    except Exception as error:  # Horovod reports it on every rank and keeps working
        print(f"dualframe-test: dtype mismatch -> {first_line(error)}", flush=True)
    hvd.allreduce(tf.ones(5 if wide else 3), name="mismatch")


class Fault(keras.callbacks.Callback):
    def __init__(self, fault):
        super().__init__()
        self.fault = fault

    def on_train_batch_begin(self, batch, logs=None):
        if batch != 2:
            return
        if hvd.rank() == 1:
            print(f"dualframe-test: fault {self.fault} at {time.time():.3f}", flush=True)
        if self.fault == "mismatch":
            mismatch()
        elif self.fault == "name" and hvd.rank() == 1:
            hvd.allreduce(tf.ones(3), name="other name")
        elif self.fault == "early" and hvd.rank() == 1:
            self.model.stop_training = True


def custom_loop(model, x):
    optimizer = keras.optimizers.SGD(0.01)

    @tf.function
    def train_step(xb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - tf.reduce_sum(xb, 1, keepdims=True)) ** 2)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    hvd.broadcast_variables(model.variables, root_rank=0)
    train_step(x[:4])  # traced outside the guard: autograph takes more than this test's 10 s on a loaded box
    for batch in range(1, len(x) // 4):
        if batch == 2 and hvd.rank() == 1:
            print(f"dualframe-test: fault loop at {time.time():.3f}", flush=True)
            time.sleep(120)  # stuck outside any collective: only rank 0's guard can end the job
        with hvd.stall_guard("a custom tf.function train step"):
            train_step(x[4 * batch:4 * batch + 4])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=("name", "early", "mismatch", "loop"), required=True)
    args = parser.parse_args()
    hvd.init()
    # Start together: under a loaded machine one rank can take seconds longer to reach its first collective,
    # which the short test timeout would call a stall. Horovod's own allreduce is not bounded by dualframe.
    horovod_tf.allreduce(tf.zeros([1]), name="keras_stall.start")
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x = np.random.randn(400, 6).astype("float32")
    if args.fault == "loop":
        custom_loop(model, x)
    model.fit(x, x.sum(1, keepdims=True), batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Fault(args.fault)])
    hvd.barrier()  # rank 1 after an early exit from fit; never reached otherwise
    raise AssertionError(f"rank {hvd.rank()} finished fit although the ranks disagreed")


if __name__ == "__main__":
    main()

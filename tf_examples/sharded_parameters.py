"""Sharded parameters (ZeRO-3) with Keras 3 ``fit``: each rank keeps 1/N of the weights and of Adam's state.

    mpirun -np 2 python tf_examples/sharded_parameters.py --epochs 2
    horovodrun -np 2 -H localhost:2 --gloo python tf_examples/sharded_parameters.py

Training is the same as plain data parallelism (the final weights agree to float rounding); what
changes is memory: between steps each rank keeps its slice of every layer's weights and their Adam
state, and a layer's full weights exist only while that layer runs forward or backward. The only
changes from a one-process Keras script are the lines marked ``# dualframe:``.
"""
import argparse
import os
import tempfile
import time

import numpy as np
import keras
import tensorflow as tf

import dualframe  # dualframe
import dualframe.tensorflow.keras as hvd  # dualframe: instead of horovod.tensorflow.keras
from sharded_optimizer import synthetic_dataset  # the ZeRO-1/2 example's data (this folder is on sys.path)


def build_model(features: int, classes: int, width: int) -> keras.Model:
    """An MLP with a residual block and layer normalization."""
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    block = keras.layers.Dense(width, activation="relu")(hidden)
    hidden = keras.layers.LayerNormalization()(keras.layers.Add()([hidden, keras.layers.Dense(width)(block)]))
    return keras.Model(inputs, keras.layers.Dense(classes)(hidden))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    hvd.init()  # dualframe
    features, classes = 20, 4
    x, y = synthetic_dataset(args.samples + 2048, features, classes, seed=0)
    (x, y), (x_test, y_test) = (x[:args.samples], y[:args.samples]), (x[args.samples:], y[args.samples:])
    train = (hvd.shard(tf.data.Dataset.from_tensor_slices((x, y)))  # dualframe: this rank's equal share
             .shuffle(4096, seed=hvd.rank()).batch(args.batch_size, drop_remainder=True))

    keras.utils.set_random_seed(1234 + hvd.rank())  # different on purpose: distribute broadcasts rank 0's
    model = build_model(features, classes, args.width)
    model.compile(optimizer=keras.optimizers.Adam(args.lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    full = 3 * 4 * model.count_params()  # weights + Adam's m and v: what one rank holds without sharding
    # dualframe: a new model whose layers gather their weights from every rank's slices; the old one is dropped
    model = hvd.distribute(model, dualframe.DataParallel(shard="parameters"))
    start = time.perf_counter()
    history = model.fit(train, epochs=args.epochs, shuffle=False, verbose=hvd.verbose(2),  # dualframe: rank 0
                        callbacks=[hvd.callbacks.MetricAverageCallback()])  # dualframe: logs averaged over ranks
    seconds = time.perf_counter() - start

    loss, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
    weights = tf.constant(np.concatenate([w.ravel() for w in model.get_weights()]))  # dualframe: gathers
    spread = hvd.allreduce(weights, op=hvd.Max) - hvd.allreduce(weights, op=hvd.Min)  # dualframe: all equal?
    mine = model.optimizer.parameter_bytes() + model.optimizer.state_bytes()  # dualframe: this rank's slices
    path = os.path.join(tempfile.gettempdir(), "sharded_parameters_example.weights.h5")
    model.save_weights(path)  # dualframe: every rank calls (it gathers); rank 0 writes a plain Keras file
    kept = hvd.allgather(tf.constant([mine], dtype=tf.int64)).numpy()  # dualframe
    if hvd.rank() == 0:  # dualframe: rank 0 prints
        print(f"ranks: {hvd.size()}, shard='parameters', epochs: {args.epochs} in {seconds:.1f} s")
        print(f"train loss: {history.history['loss'][0]:.3f} -> {history.history['loss'][-1]:.3f}, "
              f"test accuracy: {accuracy:.3f} (chance: {1 / classes:.2f})")
        print(f"weights + Adam state per rank: {[f'{b / 2**20:.2f} MiB' for b in kept]} "
              f"(unsharded: {full / 2**20:.2f} MiB each)")
        print(f"largest weight difference between ranks: {float(tf.reduce_max(spread)):.1e}; saved {path} "
              f"(plain Keras weights)")


if __name__ == "__main__":
    main()

"""Sharded optimizer (ZeRO-1/2) with Keras 3 ``fit``: each rank keeps Adam's state for 1/N of the weights only.

    mpirun -np 2 python tf_examples/sharded_optimizer.py --epochs 2
    horovodrun -np 2 -H localhost:2 --gloo python tf_examples/sharded_optimizer.py --shard gradients

Training is the same as plain data parallelism (the final weights agree to float rounding); what
changes is memory: Adam keeps two numbers per weight, and with ``shard=`` each rank keeps them for
its slice only. The only changes from a one-process Keras script are the lines marked ``# dualframe:``.
"""
import argparse
import os
import tempfile
import time

import numpy as np
import keras
import tensorflow as tf

import dualframe.tensorflow.keras as hvd  # dualframe: instead of horovod.tensorflow.keras


def synthetic_dataset(samples: int, features: int, classes: int, seed: int) -> "tuple[np.ndarray, np.ndarray]":
    """Points labelled by a fixed random teacher network: learnable, and the same on every rank."""
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, features).astype("float32")
    teacher = np.tanh(x @ rng.randn(features, 32)) @ rng.randn(32, classes)
    return x, teacher.argmax(axis=1).astype("int64")


def build_model(features: int, classes: int, width: int) -> keras.Model:
    """An MLP with a residual block, so there is some state to shard."""
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    block = keras.layers.Dense(width, activation="relu")(hidden)
    hidden = keras.layers.Add()([hidden, keras.layers.Dense(width)(block)])
    return keras.Model(inputs, keras.layers.Dense(classes)(hidden))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--shard", choices=["optimizer", "gradients"], default="optimizer",
                        help="optimizer: ZeRO-1 (state sharded); gradients: ZeRO-2 (accumulated gradients too)")
    args = parser.parse_args()

    hvd.init()  # dualframe
    features, classes = 20, 4
    x, y = synthetic_dataset(args.samples + 2048, features, classes, seed=0)
    (x, y), (x_test, y_test) = (x[:args.samples], y[:args.samples]), (x[args.samples:], y[args.samples:])
    train = (hvd.shard(tf.data.Dataset.from_tensor_slices((x, y)))  # dualframe: this rank's equal share
             .shuffle(4096, seed=hvd.rank()).batch(args.batch_size, drop_remainder=True))

    keras.utils.set_random_seed(1234 + hvd.rank())  # different on purpose: the broadcast makes them equal
    model = build_model(features, classes, args.width)
    optimizer = hvd.DistributedOptimizer(  # dualframe: reduce-scatter, update this rank's slice, allgather
        keras.optimizers.Adam(args.lr), shard=args.shard)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # dualframe: rank 0's weights first
                 hvd.callbacks.MetricAverageCallback()]  # dualframe: logs averaged over ranks
    start = time.perf_counter()
    history = model.fit(train, epochs=args.epochs, callbacks=callbacks, shuffle=False,
                        verbose=hvd.verbose(2))  # dualframe: progress on rank 0 only
    seconds = time.perf_counter() - start

    loss, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
    weights = tf.constant(np.concatenate([w.ravel() for w in model.get_weights()]))
    spread = hvd.allreduce(weights, op=hvd.Max) - hvd.allreduce(weights, op=hvd.Min)  # dualframe: all equal?
    mine = optimizer.state_bytes()  # dualframe: Adam's m and v for this rank's slice
    full = 2 * 4 * model.count_params()  # what one rank holds without sharding
    # dualframe: saving gathers the state in the plain optimizer's layout, so every rank calls save
    path = os.path.join(tempfile.gettempdir(), f"sharded_example_rank{hvd.rank()}.keras")
    model.save(path)
    state = hvd.allgather(tf.constant([mine], dtype=tf.int64)).numpy()  # dualframe
    if hvd.rank() == 0:  # dualframe: rank 0 prints
        print(f"ranks: {hvd.size()}, shard={args.shard!r}, epochs: {args.epochs} in {seconds:.1f} s")
        print(f"train loss: {history.history['loss'][0]:.3f} -> {history.history['loss'][-1]:.3f}, "
              f"test accuracy: {accuracy:.3f} (chance: {1 / classes:.2f})")
        print(f"Adam state per rank: {[f'{b / 2**20:.2f} MiB' for b in state]} "
              f"(unsharded: {full / 2**20:.2f} MiB each)")
        print(f"largest weight difference between ranks: {float(tf.reduce_max(spread)):.1e}; saved {path} "
              f"(full optimizer state, loadable with or without shard=)")


if __name__ == "__main__":
    main()

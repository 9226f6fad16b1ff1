"""Data parallelism with Keras 3 ``fit``: every rank trains the whole model on its shard; gradients are averaged.

    mpirun -np 2 python tf_examples/data_parallel.py --epochs 2
    horovodrun -np 2 -H localhost:2 --gloo python tf_examples/data_parallel.py

The only changes from a one-process Keras script are the lines marked ``# dualframe:``
(with Horovod on Keras 2 they were the same, from ``import horovod.tensorflow.keras as hvd``).
"""
import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="one-process learning rate")
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    hvd.init()  # dualframe
    features, classes = 20, 4
    x, y = synthetic_dataset(args.samples + 2048, features, classes, seed=0)
    (x, y), (x_test, y_test) = (x[:args.samples], y[:args.samples]), (x[args.samples:], y[args.samples:])
    train = (hvd.shard(tf.data.Dataset.from_tensor_slices((x, y)))  # dualframe: this rank's equal share
             .shuffle(4096, seed=hvd.rank()).batch(args.batch_size, drop_remainder=True))

    keras.utils.set_random_seed(1234 + hvd.rank())  # different on purpose: the broadcast makes them equal
    model = keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(classes),
    ])
    # The learning rate grows with the global batch; the warmup callback ramps up to it.
    optimizer = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer)  # dualframe: average gradients over ranks
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # dualframe: rank 0's weights, before step 1
        hvd.callbacks.MetricAverageCallback(),  # dualframe: logs averaged over ranks
        hvd.callbacks.LearningRateWarmupCallback(args.lr * hvd.size(), warmup_epochs=1),  # dualframe
    ]
    start = time.perf_counter()
    history = model.fit(train, epochs=args.epochs, callbacks=callbacks, shuffle=False,  # train shuffles itself
                        verbose=hvd.verbose(2))  # dualframe: progress on rank 0 only
    seconds = time.perf_counter() - start

    loss, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
    weights = tf.constant(np.concatenate([w.ravel() for w in model.get_weights()]))
    spread = hvd.allreduce(weights, op=hvd.Max) - hvd.allreduce(weights, op=hvd.Min)  # dualframe: all equal?
    if hvd.rank() == 0:  # dualframe: rank 0 prints
        print(f"ranks: {hvd.size()}, global batch: {args.batch_size * hvd.size()}, "
              f"epochs: {args.epochs} in {seconds:.1f} s")
        print(f"train loss (averaged over ranks): {history.history['loss'][0]:.3f} -> {history.history['loss'][-1]:.3f}")
        print(f"test accuracy: {accuracy:.3f} (chance: {1 / classes:.2f}), test loss: {loss:.3f}")
        print(f"largest weight difference between ranks: {float(tf.reduce_max(spread)):.1e}")


if __name__ == "__main__":
    main()

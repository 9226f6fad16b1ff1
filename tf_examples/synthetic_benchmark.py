"""Synthetic-data throughput of Keras 3 data parallelism: images/sec per rank and in total.

    mpirun -np 2 python tf_examples/synthetic_benchmark.py --model small_cnn
    horovodrun -np 4 -H host1:2,host2:2 python tf_examples/synthetic_benchmark.py --model ResNet50 --batch-size 32

As Horovod's tensorflow2_synthetic_benchmark.py: random images, warmup, then timed iterations of
``--batches-per-iter`` steps; ``# dualframe:`` marks the distributed lines.
"""
import argparse
import time

import numpy as np
import keras
import tensorflow as tf

import dualframe.tensorflow as hvd  # dualframe


def small_cnn(image_size: int, classes: int) -> keras.Model:
    """A few convolutions: compute-bound on a CPU, quick to build."""
    return keras.Sequential([
        keras.Input((image_size, image_size, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(classes),
    ])


def build_model(name: str, image_size: int, classes: int) -> keras.Model:
    if name == "small_cnn":
        return small_cnn(image_size, classes)
    return getattr(keras.applications, name)(weights=None, input_shape=(image_size, image_size, 3), classes=classes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small_cnn", help="small_cnn or a keras.applications name (ResNet50)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    args = parser.parse_args()

    hvd.init()  # dualframe
    classes = 100
    model = build_model(args.model, args.image_size, classes)
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size], maxval=classes, dtype=tf.int64)

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)  # dualframe
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)  # dualframe
    for _ in range(args.num_warmup_batches):
        step()
    rates = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        rates.append(args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start))
        if hvd.rank() == 0:
            print(f"iter #{i}: {rates[-1]:.1f} img/sec per rank")
    per_rank = np.mean(rates)
    total = float(hvd.allreduce(tf.constant(per_rank), op=hvd.Sum))  # dualframe: sum over ranks
    if hvd.rank() == 0:  # dualframe
        print(f"model: {args.model}, batch size: {args.batch_size} per rank, ranks: {hvd.size()}")
        print(f"img/sec per rank: {per_rank:.1f} +- {1.96 * np.std(rates):.1f}")
        print(f"total img/sec on {hvd.size()} rank(s): {total:.1f}")


if __name__ == "__main__":
    main()

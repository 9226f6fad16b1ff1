"""Data parallelism in a custom TensorFlow training loop: DistributedGradientTape averages the gradients.

    mpirun -np 2 python tf_examples/custom_loop.py --steps 200
    horovodrun -np 2 -H localhost:2 --gloo python tf_examples/custom_loop.py

The lines marked ``# dualframe:`` are the whole difference from a one-process loop (they were the
same with ``import horovod.tensorflow as hvd`` on Keras 2).
"""
import argparse

import numpy as np
import keras
import tensorflow as tf

import dualframe.tensorflow as hvd  # dualframe: instead of horovod.tensorflow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="one-process learning rate")
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    args = parser.parse_args()

    hvd.init()  # dualframe
    rng = np.random.RandomState(0)
    teacher = rng.randn(10, 1).astype("float32")
    x = rng.randn(args.batch_size * hvd.size() * 16, 10).astype("float32")
    y = np.sin(x @ teacher)
    dataset = (hvd.shard(tf.data.Dataset.from_tensor_slices((x, y)))  # dualframe: this rank's share
               .repeat().shuffle(1024, seed=hvd.rank()).batch(args.batch_size))

    keras.utils.set_random_seed(hvd.rank())  # different starts; the broadcast below equalizes them
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(args.lr * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(features: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(targets, model(features, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)  # dualframe: averaged gradients
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)  # dualframe: same start
    for step, (features, targets) in enumerate(dataset.take(args.steps)):
        loss = train_step(features, targets)
        if step % 50 == 0 or step == args.steps - 1:
            mean_loss = hvd.allreduce(loss, op=hvd.Average)  # dualframe: the loss over all ranks
            if hvd.rank() == 0:  # dualframe: rank 0 prints
                print(f"step {step:4d}  loss {float(mean_loss):.4f}")
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], axis=0)
    spread = hvd.allreduce(flat, op=hvd.Max) - hvd.allreduce(flat, op=hvd.Min)  # dualframe
    if hvd.rank() == 0:
        print(f"ranks: {hvd.size()}, largest weight difference between ranks: {float(tf.reduce_max(spread)):.1e}")


if __name__ == "__main__":
    main()

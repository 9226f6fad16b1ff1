"""GPipe pipeline for Keras 3: layers split over devices, each batch cut into micro-batches so the devices work at once.

    python tf_examples/pipeline.py                                      # visible GPUs, else 2 logical CPUs
    python tf_examples/pipeline.py --devices /GPU:0,/GPU:1 --chunks 8 --timeline gpipe.png
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dualframe.tensorflow as hvd  # noqa: E402
from dualframe.observe.timeline import report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="comma-separated, one per stage (e.g. /CPU:0,/CPU:1 or /GPU:0,/GPU:1)")
    parser.add_argument("--stages", type=int, default=2, help="number of stages when --devices is omitted")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeline", help="write an eager step's Gantt chart to this PNG")
    parser.add_argument("--trace", help="write an eager step's Chrome trace here")
    args = parser.parse_args()

    devices = hvd.stage_devices(args.devices, args.stages)  # dualframe: GPUs, else logical CPUs
    keras.utils.set_random_seed(0)
    parts = [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth + 1)] + [keras.layers.Dense(1)]
    sample = tf.random.normal((args.batch // args.chunks, 16))
    stages = len(devices) if devices else args.stages
    balance = hvd.balance_by_time(parts, sample, stages)  # dualframe: even measured time per stage
    pipe = hvd.Pipeline(parts, balance, devices, chunks=args.chunks, checkpoint=args.checkpoint)  # dualframe:
    print(f"balance {balance} on {list(pipe.devices)}, chunks {args.chunks}, checkpoint {args.checkpoint}")

    rng = np.random.RandomState(1)
    x = rng.randn(600, 16).astype("float32")  # 600 = 9 x 64 + 24: the last batch is smaller
    y = np.sin(x[:, :4].sum(1, keepdims=True)).astype("float32")
    pipe.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    start = time.perf_counter()
    history = pipe.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
    print(f"{args.epochs} epochs in {time.perf_counter() - start:.2f} s, loss "
          + " -> ".join(f"{v:.4f}" for v in history.history["loss"]))

    # One eager step, recorded: eager cells run one after another (in fit's graph TensorFlow overlaps
    # independent cells on different devices, which this timeline does not see).
    def eager_step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((pipe(x[:args.batch], training=True) - y[:args.batch]) ** 2)
        tape.gradient(loss, pipe.trainable_variables)

    eager_step()  # warm-up: the first eager call builds what it needs
    with pipe.record() as timeline:  # dualframe:
        eager_step()
    print(report(timeline.events, trace=args.trace, png=args.timeline))


if __name__ == "__main__":
    main()

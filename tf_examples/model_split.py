"""Model parallelism for Keras 3: layers split into groups whose variables live on explicit devices.

    python tf_examples/model_split.py                                  # visible GPUs, else 2 logical CPUs
    python tf_examples/model_split.py --devices /GPU:0,/GPU:1 --timeline split.png
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


def layers(width: int, depth: int) -> list:
    keras.utils.set_random_seed(0)
    return ([keras.layers.Dense(width, activation="relu") for _ in range(depth + 1)] + [keras.layers.Dense(1)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="comma-separated, one per group (e.g. /CPU:0,/CPU:1 or /GPU:0,/GPU:1)")
    parser.add_argument("--groups", type=int, default=2, help="number of groups when --devices is omitted")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeline", help="write an eager step's Gantt chart to this PNG")
    parser.add_argument("--trace", help="write an eager step's Chrome trace here")
    args = parser.parse_args()

    devices = hvd.stage_devices(args.devices, args.groups)  # dualframe: GPUs, else logical CPUs
    parts = layers(args.width, args.depth)
    groups = len(devices) if devices else args.groups
    balance = [len(parts) // groups + (1 if j < len(parts) % groups else 0) for j in range(groups)]
    model = hvd.ModelParallel(parts, balance, devices)  # dualframe: group j's variables on devices[j]
    model.build((None, 16))
    kernels = [w.value.device.rsplit("device:", 1)[-1] for w in model.weights if w.path.endswith("kernel")]
    print(f"balance {balance} on {list(model.devices)}; kernels, in layer order, on: {', '.join(kernels)}")

    rng = np.random.RandomState(1)
    x = rng.randn(640, 16).astype("float32")
    y = np.sin(x[:, :4].sum(1, keepdims=True)).astype("float32")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
    print(f"{args.epochs} epochs in {time.perf_counter() - start:.2f} s, loss "
          + " -> ".join(f"{v:.4f}" for v in history.history["loss"]))

    # One eager step, recorded (inside fit TensorFlow runs a graph, which dualframe does not time).
    def eager_step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x[:args.batch], training=True) - y[:args.batch]) ** 2)
        tape.gradient(loss, model.trainable_variables)

    eager_step()  # warm-up: the first eager call builds what it needs
    with model.record() as timeline:  # dualframe:
        eager_step()
    print(report(timeline.events, trace=args.trace, png=args.timeline))


if __name__ == "__main__":
    main()

"""Split a functional Keras ResNet (skip connections, BatchNorm) across two devices, cuts chosen by measured time.

    python tf_examples/model_split_resnet.py                           # visible GPUs, else 2 logical CPUs
    mpirun -np 2 python tf_examples/model_split_resnet.py              # one stage per process
    python tf_examples/model_split_resnet.py --split-points block3_conv1 --chunks 4 --timeline resnet.png
    python tf_examples/model_split_resnet.py --resnet50                # keras.applications.ResNet50, 32x32
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dualframe.tensorflow as hvd  # noqa: E402
from dualframe.launch.topology import detect  # noqa: E402
from dualframe.observe.timeline import report  # noqa: E402

CLASSES = 4


def resnet(width: int, blocks: int, size: int) -> keras.Model:
    """A small ResNet: a stem, residual blocks (every other one halving the resolution), pooled logits."""
    keras.utils.set_random_seed(0)
    x = keras.Input((size, size, 3), name="image")
    h = keras.layers.Conv2D(width, 3, padding="same", activation="relu", name="stem")(x)
    for b in range(blocks):
        stride, w = (2, width * 2) if b % 2 else (1, width)
        y = keras.layers.Conv2D(w, 3, strides=stride, padding="same", name=f"block{b}_conv1")(h)
        y = keras.layers.BatchNormalization(name=f"block{b}_bn1")(y)
        y = keras.layers.Activation("relu", name=f"block{b}_relu")(y)
        y = keras.layers.Conv2D(w, 3, padding="same", name=f"block{b}_conv2")(y)
        y = keras.layers.BatchNormalization(name=f"block{b}_bn2")(y)
        if stride > 1 or h.shape[-1] != w:
            h = keras.layers.Conv2D(w, 1, strides=stride, name=f"block{b}_proj")(h)
        h = keras.layers.Activation("relu", name=f"block{b}_out")(keras.layers.Add(name=f"block{b}_add")([y, h]))
        width = w
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, keras.layers.Dense(CLASSES, name="logits")(h), name="resnet")


def synthetic(rows: int, size: int, seed: int) -> tuple:
    """Images whose class is the quadrant holding a bright square: learnable, no download."""
    rng = np.random.RandomState(seed)
    x = rng.normal(0, 0.3, (rows, size, size, 3)).astype("float32")
    y = rng.randint(0, CLASSES, rows)
    half, side = size // 2, max(2, size // 4)
    for k, c in enumerate(y):
        top, left = (c // 2) * half + rng.randint(0, half - side + 1), (c % 2) * half + rng.randint(0, half - side + 1)
        x[k, top:top + side, left:left + side] += 1.5
    return x, y


def train_processes(args: argparse.Namespace, model: keras.Model, x: np.ndarray, y: np.ndarray) -> None:
    """One stage per process; every rank cuts alike (named layers, or even bytes from the static shapes)."""
    cut = {"split_points": args.split_points.split(",")} if args.split_points else {"stages": hvd.size()}
    pipe = hvd.DistributedPipeline(model, chunks=args.chunks, loss_fn=keras.losses.SparseCategoricalCrossentropy(True),
                                   **cut)  # dualframe: each tensor goes straight to the stages that read it
    optimizer = keras.optimizers.Adam(2e-3)
    for epoch in range(args.epochs):
        losses = []
        for start in range(0, len(x), args.batch):  # dualframe: images read on stage 0, labels on the last
            losses.append(pipe.train_step(x[start:start + args.batch], y[start:start + args.batch]))
            pipe.apply_gradients(optimizer)  # dualframe: the stage's gradients, summed over micro-batches
        if hvd.rank() == 0:
            print(f"epoch {epoch}  loss {np.mean(losses):.3f}", flush=True)
    timings = pipe.timings()  # dualframe: every stage's line (a collective)
    if hvd.rank() == 0:
        print(f"split points {list(pipe.split.split_points)}")
        print("\n".join("  " + line for line in timings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="comma-separated, one per stage (e.g. /CPU:0,/CPU:1 or /GPU:0,/GPU:1)")
    parser.add_argument("--split-points", help="comma-separated layer names where stages begin (default: measured)")
    parser.add_argument("--resnet50", action="store_true", help="keras.applications.ResNet50 instead of the small one")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeline", help="write an eager step's Gantt chart to this PNG")
    args = parser.parse_args()

    processes = detect().distributed  # dualframe: launched with -np 2: one stage per process
    if processes:
        hvd.init()  # dualframe:
    devices = None if processes else hvd.stage_devices(args.devices, 2)  # dualframe: GPUs, else logical CPUs
    if args.resnet50:
        args.size = 32
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=CLASSES)
    else:
        model = resnet(args.width, args.blocks, args.size)
    x, y = synthetic(640, args.size, seed=1)
    if processes:
        return train_processes(args, model, x, y)
    if args.split_points:
        cut = {"split_points": args.split_points.split(",")}  # dualframe: a new stage begins at each name
    else:
        cut = {"stages": len(devices) if devices else 2, "sample": x[:args.batch // args.chunks]}  # dualframe:
    # dualframe: the model's own layers, cut where stages cost the same and few bytes cross; each tensor goes
    # to each stage that reads it. BatchNorm: no recomputation (checkpoint="never"), moving statistics once.
    pipe = hvd.Pipeline(model, devices=devices, chunks=args.chunks, checkpoint="never", **cut)
    print(f"{len(model.layers)} layers, balance {pipe.balance}, split points {list(pipe.split_points)}")
    print(pipe.describe())  # dualframe: the stages and the tensors crossing each boundary, with their sizes

    pipe.compile(optimizer=keras.optimizers.Adam(2e-3), loss=keras.losses.SparseCategoricalCrossentropy(True),
                 metrics=["accuracy"])
    start = time.perf_counter()
    history = pipe.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
    print(f"{args.epochs} epochs in {time.perf_counter() - start:.2f} s, loss "
          + " -> ".join(f"{v:.3f}" for v in history.history["loss"])
          + ", accuracy " + " -> ".join(f"{v:.2f}" for v in history.history["accuracy"]))
    test_x, test_y = synthetic(256, args.size, seed=2)
    accuracy = np.mean(np.argmax(pipe.predict(test_x, batch_size=args.batch, verbose=0), 1) == test_y)
    print(f"held-out accuracy {accuracy:.2f} (chance {1 / CLASSES:.2f})")

    # One eager step, recorded: per-stage forward/backward time and the bubble (in fit's graph TensorFlow
    # overlaps independent cells on different devices, which this timeline does not see).
    def eager_step() -> None:
        with tf.GradientTape() as tape:
            logits = pipe(x[:args.batch], training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y[:args.batch], logits, True))
        tape.gradient(loss, pipe.trainable_variables)

    eager_step()  # warm-up
    with pipe.record() as timeline:  # dualframe:
        eager_step()
    print(report(timeline.events, png=args.timeline))


if __name__ == "__main__":
    main()

"""Seconds of the first steps of a Keras process pipeline (XLA on, off, auto) against a plain Keras model's first fit steps.

    flock /tmp/dualframe-mp.lock mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none \\
        -x OMP_NUM_THREADS=1 -x TF_NUM_INTRAOP_THREADS=1 -x TF_NUM_INTEROP_THREADS=1 -x PATH \\
        .venv/bin/python scripts/bench_first_steps_tf.py --model conv --arm auto

One arm per launch (a fresh process pair: nothing compiled before it): ``xla``, ``plain`` or ``auto``
run ``DistributedPipeline(stages=2, chunks=4, jit_compile=True / False / default)``; ``fit`` runs the
unsplit model's ``model.fit`` in each process (what a user compares against: Keras decides its own
compilation, no XLA on a CPU-only machine). Models: ``conv`` (a functional ResNet: 3 stages of 2
residual blocks, BatchNormalization, 32x32x3 images), ``resnet50`` (``keras.applications``,
``weights=None``, 32x32x3), ``mlp`` (residual Dense blocks) and ``gpt2``
(keras_hub ``GPT2Backbone``, 4 layers, hidden 64, no dropout). Prints each step's seconds on rank 0.
"""
import time

import bench_env

bench_env.one_thread_per_process()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import bench_common  # noqa: E402
import dualframe.tensorflow as hvd  # noqa: E402
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline  # noqa: E402

ARMS = {"xla": True, "plain": False, "auto": None}


def conv_net() -> keras.Model:
    x = keras.Input((32, 32, 3), name="image")
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="stem")(x)
    for s, width in enumerate((16, 32, 64)):
        for b in range(2):
            stride = 2 if s and not b else 1
            y = keras.layers.Conv2D(width, 3, strides=stride, padding="same", name=f"s{s}b{b}_conv1")(h)
            y = keras.layers.ReLU(name=f"s{s}b{b}_relu")(keras.layers.BatchNormalization(name=f"s{s}b{b}_bn")(y))
            y = keras.layers.Conv2D(width, 3, padding="same", name=f"s{s}b{b}_conv2")(y)
            if stride > 1 or h.shape[-1] != width:
                h = keras.layers.Conv2D(width, 1, strides=stride, name=f"s{s}b{b}_proj")(h)
            h = keras.layers.ReLU(name=f"s{s}b{b}_out")(keras.layers.Add(name=f"s{s}b{b}_add")([y, h]))
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, keras.layers.Dense(10, name="logits")(h), name="conv")


def resnet50() -> keras.Model:
    return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)


def mlp(width: int = 512, blocks: int = 6) -> keras.Model:
    x = keras.Input((width,), name="x")
    h = x
    for b in range(blocks):
        f = keras.layers.Dense(width, activation="relu", name=f"b{b}_fc1")(h)
        h = keras.layers.Add(name=f"b{b}_add")([h, keras.layers.Dense(width, name=f"b{b}_fc2")(f)])
    return keras.Model(x, keras.layers.Dense(10, name="head")(h), name="mlp")


def gpt2() -> keras.Model:
    import keras_hub  # only this model needs it

    return keras_hub.models.GPT2Backbone(vocabulary_size=1000, num_layers=4, num_heads=4, hidden_dim=64,
                                         intermediate_dim=128, max_sequence_length=64, dropout=0.0)


def data(model: str, batch: int) -> tuple:
    rng = np.random.RandomState(0)
    if model in ("conv", "resnet50"):
        return rng.randn(batch, 32, 32, 3).astype("float32"), rng.randn(batch, 10).astype("float32")
    if model == "mlp":
        return rng.randn(batch, 512).astype("float32"), rng.randn(batch, 10).astype("float32")
    x = {"token_ids": rng.randint(0, 1000, (batch, 64)), "padding_mask": np.ones((batch, 64), bool)}
    return x, rng.randn(batch, 64, 64).astype("float32")


def first_steps(model: keras.Model, arm: str, x, y, steps: int, chunks: int) -> list:
    optimizer = keras.optimizers.SGD(1e-3)
    times = []
    if arm == "fit":
        model.compile(optimizer=optimizer, loss="mse")
        for _ in range(steps):  # one fit call per step: its first call includes Keras's own tracing
            start = time.perf_counter()
            model.fit(x, y, batch_size=len(y), epochs=1, verbose=0, shuffle=False)
            times.append(time.perf_counter() - start)
        return times
    kwargs = {} if ARMS[arm] is None else {"jit_compile": ARMS[arm]}
    pipe = DistributedPipeline(model, stages=2, chunks=chunks, loss_fn="mse", **kwargs)
    for _ in range(steps):
        hvd.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y)
        pipe.apply_gradients(optimizer)
        hvd.barrier()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = bench_common.parser(__doc__, batch=32, chunks=4, steps=5)
    parser.add_argument("--model", choices=("conv", "resnet50", "mlp", "gpt2"), default="conv")
    parser.add_argument("--arm", choices=(*ARMS, "fit"), default="auto")
    args = parser.parse_args()
    bench_common.init_two_processes(hvd)
    keras.utils.set_random_seed(0)
    model = {"conv": conv_net, "resnet50": resnet50, "mlp": mlp, "gpt2": gpt2}[args.model]()
    x, y = data(args.model, args.batch)
    times = first_steps(model, args.arm, x, y, args.steps, args.chunks)
    rows = hvd.allgather_object(times)
    line = " ".join(f"{max(r[k] for r in rows):.2f}" for k in range(args.steps))
    bench_common.print_report(hvd.rank(), f"{args.model}, batch {args.batch}, chunks {args.chunks}, arm {args.arm}",
                              [f"seconds of steps 1..{args.steps} (slowest rank): {line}"])


if __name__ == "__main__":
    main()

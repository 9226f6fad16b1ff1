"""Overhead of the Keras 3 Pipeline with every group on one device vs the plain model; prints ratios.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_pipeline_tf.py

The TensorFlow twin of ``scripts/bench_pipeline.py``'s overhead part (a separate process: torch and
TensorFlow never load in one). A training step is a ``tf.function`` (GradientTape, gradients of all
variables, no optimizer) on the same batch; A B rounds interleaved, median ratio of step times in
process CPU time (robust to a loaded machine) and wall time. Beside the Pipeline: the plain model run
on 4 micro-batches inside one step (what micro-batching itself costs). Goal <= 1.10.
"""
import os
import statistics
import time

import bench_env

bench_env.one_thread_per_process()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import bench_common  # noqa: E402
import dualframe.tensorflow as hvd  # noqa: E402


def dense_layers(width: int, depth: int) -> list:
    keras.utils.set_random_seed(0)
    return [keras.layers.Dense(width, activation="relu") for _ in range(depth)]


def train_step(model: keras.Model, chunks: int = 1):
    """A compiled step: gradients of mean(out^2); chunks > 1 runs the model on micro-batches."""

    @tf.function(jit_compile=False)
    def step(x: tf.Tensor) -> list:
        with tf.GradientTape() as tape:
            parts = tf.split(x, chunks) if chunks > 1 else [x]
            out = tf.concat([model(p, training=True) for p in parts], axis=0)
            loss = tf.reduce_mean(tf.square(out))
        return tape.gradient(loss, model.trainable_variables)

    return step


def step_time(step, x: tf.Tensor, steps: int) -> "tuple[float, float]":
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        grads = step(x)
    float(grads[0][0, 0])  # wait for the last step
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    args = bench_common.parser(__doc__, helps={"depth": "Dense(width, relu) layers, half per group"},
                               width=512, depth=12, batch=2048, steps=2, rounds=7).parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}, {os.cpu_count()} cores, one thread, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    x = tf.random.normal((args.batch, args.width), seed=1)
    plain = keras.Sequential(dense_layers(args.width, args.depth))
    half = args.depth // 2
    variants = {f"Pipeline(chunks={c})": train_step(hvd.Pipeline(
        dense_layers(args.width, args.depth), [half, args.depth - half], ["/CPU:0", "/CPU:0"], chunks=c,
        checkpoint="never")) for c in (1, 4)}
    variants["plain model, 4 micro-batches in the step"] = train_step(plain, chunks=4)
    base = train_step(plain)
    for step in [base, *variants.values()]:
        step_time(step, x, 2)  # trace and warm up
    ratios: dict = {name: ([], []) for name in variants}
    for r in range(args.rounds):
        for name, step in variants.items():
            pair = [(base, True), (step, False)] if r % 2 == 0 else [(step, False), (base, True)]
            times = {is_base: step_time(fn, x, args.steps) for fn, is_base in pair}
            ratios[name][0].append(times[False][0] / times[True][0])
            ratios[name][1].append(times[False][1] / times[True][1])
    print(f"[overhead, Keras 3] {args.depth} x Dense({args.width}, relu), batch {args.batch}, 2 groups both on "
          f"/CPU:0, checkpoint=never, tf.function step, {args.rounds} interleaved A/B rounds x {args.steps} "
          f"steps; ratio of step time to the plain model on the same batch (median)")
    for name, (wall, cpu) in ratios.items():
        print(f"  {name}: CPU time {statistics.median(cpu):.3f} (rounds {', '.join(f'{v:.2f}' for v in cpu)}); "
              f"wall {statistics.median(wall):.3f} (rounds {', '.join(f'{v:.2f}' for v in wall)})")


if __name__ == "__main__":
    main()

"""Benchmark of ZB-H1 against 1F1B on a functional Keras model's graph stages (2 processes, one thread each).

    flock /tmp/dualframe-bench.lock mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none \\
        -x OMP_NUM_THREADS=1 -x TF_NUM_INTRAOP_THREADS=1 -x TF_NUM_INTEROP_THREADS=1 -x PATH \\
        .venv/bin/python scripts/bench_graph_pipeline_tf.py

The model: ``blocks`` residual blocks (h + Dense(width)(ReLU(Dense(width)(h)))), a functional
``keras.Model`` cut into 2 graph stages with ``stages=2``; the Keras layer-list twin is part 4 of
``bench_dist_pipeline_tf.py``. From interleaved rounds (A B A B ..., median of the per-round ratios,
each configuration warmed up by two steps first: traces, XLA compilation, shape headers) it prints
the throughput zb-h1 / 1f1b at ``--chunks`` micro-batches, the seconds per step, and for each schedule
the measured bubble (1 - mean stage busy / longest stage step) beside its theory ((n-1)/(m+n-1) and
(n-1)/(3m+n-1)), the computing seconds per stage (ZB-H1's B re-runs each node from its kept inputs
and W re-runs the nodes that own weights, so it may compute more: ``dualframe.tensorflow.pipeline.graph_backward``)
and the micro-batches each rank held at once.
"""
import bench_env

bench_env.one_thread_per_process()

import keras  # noqa: E402

import bench_common  # noqa: E402
import dualframe.tensorflow as hvd  # noqa: E402
from bench_keras import random_xy, zb_against_1f1b  # noqa: E402
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline  # noqa: E402


def build_model(width: int, blocks: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((width,), name="x")
    h = x
    for b in range(blocks):
        f = keras.layers.Dense(width, name=f"b{b}_fc1")(h)
        f = keras.layers.ReLU(name=f"b{b}_relu")(f)  # its own layer: B re-runs no product (graph_split_backward)
        f = keras.layers.Dense(width, name=f"b{b}_fc2")(f)
        h = keras.layers.Add(name=f"b{b}_add")([h, f])
    return keras.Model(x, h)


def ours(model, chunks, schedule):
    pipe = DistributedPipeline(model, stages=2, chunks=chunks, schedule=schedule, loss_fn="mse")
    optimizer = keras.optimizers.SGD(1e-4)

    def step(x, y):
        pipe.train_step(x, y)
        pipe.apply_gradients(optimizer)
    return pipe, step


def main() -> None:
    args = bench_common.parser(__doc__, width=512, blocks=6, batch=2048, chunks=8, rounds=5, steps=2).parse_args()
    bench_common.init_two_processes(hvd)
    x, y = random_xy(args.batch, args.width)
    model = build_model(args.width, args.blocks)
    transport, lines = zb_against_1f1b(lambda m, schedule: ours(model, m, schedule), x, y, args.chunks, args.rounds,
                                       args.steps)
    model_text = (f"Keras {keras.__version__}: functional model, {args.blocks} x residual (Dense({args.width}), ReLU, "
                  f"Dense({args.width}), Add)")
    header = bench_common.two_stage_header(model_text, args, "2 graph stages (stages=2)")
    bench_common.print_report(hvd.rank(), f"{header}, messages over {transport}", lines)


if __name__ == "__main__":
    main()

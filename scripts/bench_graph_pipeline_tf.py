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
and W re-runs the nodes that own weights, so it may compute more: ``dualframe.tensorflow.graph_split_backward``)
and the micro-batches each rank held at once.
"""
import argparse
import functools
import os
import sys

for name in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
    os.environ.setdefault(name, "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import dualframe.tensorflow as hvd  # noqa: E402
from dualframe.observe.bench_rounds import interleaved, ratio_line, seconds_line, timed_steps  # noqa: E402
from dualframe.pipeline.clock import gpipe_bubble, zb_h1_bubble  # noqa: E402
from dualframe.pipeline.walk import pipeline_bubble  # noqa: E402
from dualframe.tensorflow.distributed_pipeline import DistributedPipeline  # noqa: E402


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    hvd.init()
    if hvd.size() != 2:
        raise SystemExit(f"run with 2 processes (processes: {hvd.size()})")
    rng = np.random.RandomState(0)
    x = rng.randn(args.batch, args.width).astype("float32")
    y = rng.randn(args.batch, args.width).astype("float32")
    model, m = build_model(args.width, args.blocks), args.chunks
    pipes, configs = {}, {}
    for schedule in ("1f1b", "zb-h1"):
        pipes[schedule], configs[f"{schedule} m={m}"] = ours(model, m, schedule)
    for name, step in configs.items():  # warm-up: traces, XLA compilation, shape headers
        step(x, y)
        step(x, y)
        pipes[name.split()[0]].records.records = []  # the bubbles below: timed steps only (the first left out)
    times = interleaved({name: functools.partial(timed_steps, step, (x, y), args.steps, hvd.barrier) for name, step in configs.items()},
                        args.rounds)
    per_step = {name: [t / args.steps for t in ts] for name, ts in times.items()}
    report = [f"Keras {keras.__version__}: functional model, {args.blocks} x residual (Dense({args.width}), ReLU, "
              f"Dense({args.width}), Add), batch {args.batch}, 2 graph stages (stages=2), 1 thread per process, "
              f"{args.rounds} rounds of {args.steps} steps, messages over {pipes['zb-h1'].transport}",
              ratio_line(f"zb-h1 m={m} / 1f1b m={m}", times[f"1f1b m={m}"], times[f"zb-h1 m={m}"]),
              seconds_line(per_step).replace("step seconds (median)", "seconds per step (median over rounds)")]
    theory = {"1f1b": gpipe_bubble(2, m), "zb-h1": zb_h1_bubble(2, m)}
    for schedule, pipe in pipes.items():
        busy, walls, held = zip(*hvd.allgather_object(
            (pipe.records.mean_busy(), pipe.records.mean_wall(), pipe.peak_live)))
        report.append(f"bubble {schedule} m={m}: measured {pipeline_bubble(busy, walls):.1%}, theory "
                      f"{theory[schedule]:.1%}; walk {max(walls):.3f} s, computing per stage s: "
                      f"{' '.join(f'{b:.3f}' for b in busy)}; micro-batches held per rank: {list(held)}")
    if hvd.rank() == 0:
        print("\n".join(report), flush=True)


if __name__ == "__main__":
    main()

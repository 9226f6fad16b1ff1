"""A pipeline whose stages are processes: rank j holds stage j of a Keras model, trained with compile and fit.

    mpirun -np 2 python tf_examples/pipeline_processes.py
    horovodrun -np 2 -H localhost:2 --gloo python tf_examples/pipeline_processes.py --schedule 1f1b
"""
import argparse
import time

import keras
import numpy as np

import dualframe.tensorflow as hvd
from dualframe.pipeline.clock import clock_table, table_bubble
from dualframe.pipeline.schedule import rank_schedule


def build_model(width: int, blocks: int) -> keras.Sequential:
    keras.utils.set_random_seed(0)  # every rank builds the same model, then keeps its stage
    layers = [keras.Input((width,))]
    for _ in range(blocks):
        layers += [keras.layers.Dense(width), keras.layers.ReLU()]
    return keras.Sequential(layers + [keras.layers.Dense(1)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12, help="batches per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    hvd.init()  # dualframe:
    stages = hvd.size()  # dualframe: one stage per process
    model = build_model(args.width, args.blocks)
    per_stage, extra = divmod(len(model.layers), stages)
    balance = [per_stage + (1 if j < extra else 0) for j in range(stages)]
    pipe = hvd.DistributedPipeline(model, balance, chunks=args.chunks, schedule=args.schedule)  # dualframe:
    pipe.compile(keras.optimizers.SGD(0.01), loss="mse")  # the optimizer steps the local stage's variables

    rng = np.random.RandomState(1)
    x = rng.randn(args.batch * args.steps, args.width).astype("float32")
    y = np.sin(x[:, :1])
    start = time.perf_counter()
    # dualframe: every rank calls fit alike; stage 0 reads x, the last stage y; one progress bar (the last stage)
    history = pipe.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=2)
    elapsed = time.perf_counter() - start
    loss = history.history["loss"][-1]  # the same History on every rank

    timings = pipe.timings()  # dualframe: every stage's line (a collective), printed on rank 0
    if hvd.rank() == 0:
        theory = table_bubble(clock_table(rank_schedule(args.schedule, stages, args.chunks)))
        print(f"{args.schedule}, {stages} stages {balance}, chunks {args.chunks}: "
              f"{args.epochs * len(x) / elapsed:.0f} samples/s (first step's tracing included), final loss {loss:.5f}")
        for line in timings:
            print("  " + line)
        print(f"  bubble in theory (n-1)/(m+n-1) = {theory:.1%}")


if __name__ == "__main__":
    main()

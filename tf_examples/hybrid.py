"""Hybrid data x pipeline parallelism in Keras: replicas of a 2-stage process pipeline trained with fit, gradients averaged per stage.

    mpirun -np 4 python tf_examples/hybrid.py                               # 2 replicas x 2 stages
    mpirun -np 4 python tf_examples/hybrid.py --shard parameters            # each replica 1/2 of its stage (ZeRO-3)
    horovodrun -np 2 -H localhost:2 --gloo python tf_examples/hybrid.py     # 1 replica x 2 stages
"""
import argparse
import time

import keras
import numpy as np

import dualframe
import dualframe.tensorflow as hvd
from dualframe.pipeline.clock import clock_table, table_bubble
from dualframe.pipeline.layout import pipeline_process_sets
from dualframe.pipeline.schedule import rank_schedule

STAGES = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12, help="global batches per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--shard", default="none", choices=["none", "optimizer", "gradients", "parameters"],
                        help="shard among each stage's replicas: optimizer state (ZeRO-1), + gradients (ZeRO-2), "
                             "+ parameters between steps (ZeRO-3)")
    args = parser.parse_args()

    hvd.init(process_sets=pipeline_process_sets(dualframe.detect_topology().size, STAGES))  # dualframe: stage pairs, stage replicas
    replicas = hvd.size() // STAGES
    keras.utils.set_random_seed(0)  # the same data on every rank; the stage's replicas start from replica 0's weights
    model = keras.Sequential([keras.Input((args.width,))] + [
        layer for _ in range(3) for layer in (keras.layers.Dense(args.width), keras.layers.ReLU())
    ] + [keras.layers.Dense(1)])
    pipe = hvd.DistributedPipeline(model, [4, 3], chunks=args.chunks, schedule=args.schedule,  # dualframe:
                                   data_parallel=replicas)
    # dualframe: averages each stage's gradients among that stage's replicas only (and shards among them);
    # compile takes the optimizer distributed_optimizer returns as it is
    optimizer = pipe.distributed_optimizer(keras.optimizers.SGD(0.01, momentum=0.9),
                                           shard=None if args.shard == "none" else args.shard)
    pipe.compile(optimizer, loss="mse")

    rng = np.random.RandomState(1)
    x = rng.randn(args.global_batch * args.steps, args.width).astype("float32")
    y = np.cos(x[:, :1])
    start = time.perf_counter()
    # dualframe: every rank passes the global batches; each replica trains on its share of each
    history = pipe.fit(x, y, batch_size=args.global_batch, epochs=args.epochs, verbose=2)
    elapsed = time.perf_counter() - start
    losses = history.history["loss"]  # each epoch's mean over the global batches, the same on every rank

    timings = pipe.timings()  # dualframe: every stage's line (a collective)
    if hvd.rank() == 0:
        print(f"{replicas} replicas x {STAGES} stages, {args.schedule}, chunks {args.chunks}, shard {args.shard}: "
              f"{args.epochs * len(x) / elapsed:.0f} samples/s, loss per epoch "
              + " -> ".join(f"{loss:.5f}" for loss in losses))
        if pipe.sharded is not None:  # dualframe: ZeRO-3 keeps 1/replicas of the stage between steps
            print(f"  stage 0 holds {pipe.sharded.held_bytes() / 2**20:.2f} MiB of values and optimizer state "
                  f"between steps on this rank, of {pipe.sharded.full_bytes() / 2**20:.2f} MiB unsharded")
        for line in timings:
            print("  " + line)
        theory = table_bubble(clock_table(rank_schedule(args.schedule, STAGES, args.chunks)))
        print(f"  bubble in theory (n-1)/(m+n-1) = {theory:.1%}")


if __name__ == "__main__":
    main()

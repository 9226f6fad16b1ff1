"""Hybrid data x pipeline parallelism: replicas of a 2-stage process pipeline, gradients averaged per stage.

    mpirun -np 4 python torch_examples/hybrid.py                # 2 replicas x 2 stages
    mpirun -np 4 python torch_examples/hybrid.py --shard parameters   # each replica 1/2 of its stage (ZeRO-3)
    horovodrun -np 2 -H localhost:2 --gloo python torch_examples/hybrid.py   # 1 replica x 2 stages
"""
import argparse
import time

import torch
from torch import nn

import dualframe
import dualframe.torch as hvd
from dualframe.pipeline.layout import pipeline_process_sets

STAGES = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--shard", default="none", choices=["none", "optimizer", "gradients", "parameters"],
                        help="shard among each stage's replicas: optimizer state (ZeRO-1), + gradients (ZeRO-2), "
                             "+ parameters between steps (ZeRO-3)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    hvd.init(process_sets=pipeline_process_sets(dualframe.detect_topology().size, STAGES))  # dualframe: stage pairs, stage replicas
    replicas = hvd.size() // STAGES
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1))
    pipe = hvd.DistributedPipeline(model, [4, 3], chunks=args.chunks, schedule=args.schedule,  # dualframe:
                                   loss_fn=nn.MSELoss(), data_parallel=replicas)
    # dualframe: averages each stage's gradients among that stage's replicas only (and shards among them)
    optimizer = pipe.distributed_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.01, momentum=0.9),
                                           shard=None if args.shard == "none" else args.shard)

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.global_batch, args.width, generator=generator)
    y = x[:, :1].cos()
    rows = args.global_batch // replicas
    shard = slice(pipe.replica * rows, (pipe.replica + 1) * rows)  # dualframe: each replica its share
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = pipe.train_step(x[shard], y[shard])  # dualframe: mean loss over the global batch
        optimizer.step()
        if hvd.rank() == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss:.5f}", flush=True)
    elapsed = time.perf_counter() - start

    timings = pipe.timings()  # dualframe: every stage's line (a collective)
    if hvd.rank() == 0:
        print(f"{replicas} replicas x {STAGES} stages, {args.schedule}, chunks {args.chunks}: "
              f"{args.steps * args.global_batch / elapsed:.0f} samples/s, final loss {loss:.5f}")
        for line in timings:
            print("  " + line)


if __name__ == "__main__":
    main()

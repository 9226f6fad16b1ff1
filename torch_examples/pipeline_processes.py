"""A pipeline whose stages are processes: rank j holds stage j of an nn.Sequential (GPipe or 1F1B).

    mpirun -np 2 python torch_examples/pipeline_processes.py
    horovodrun -np 2 -H localhost:2 --gloo python torch_examples/pipeline_processes.py --schedule 1f1b
"""
import argparse
import time

import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.pipeline.clock import clock_table, table_bubble
from dualframe.pipeline.schedule import rank_schedule


def build_model(width: int, blocks: int) -> nn.Sequential:
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b", "zb-h1"])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per process: the stages share the cores

    hvd.init()  # dualframe:
    stages = hvd.size()  # dualframe: one stage per process
    torch.manual_seed(0)  # every rank builds the same model, then keeps its stage
    model = build_model(args.width, args.blocks)
    per_stage, extra = divmod(len(model), stages)
    balance = [per_stage + (1 if j < extra else 0) for j in range(stages)]
    pipe = hvd.DistributedPipeline(model, balance, chunks=args.chunks, schedule=args.schedule,  # dualframe:
                                   loss_fn=nn.MSELoss())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)  # the local stage's parameters only

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=generator)
    y = x[:, :1].sin()
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = pipe.train_step(x, y)  # dualframe: inputs read on stage 0, targets on the last stage
        optimizer.step()
        if hvd.rank() == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss:.5f}", flush=True)
    elapsed = time.perf_counter() - start

    timings = pipe.timings()  # dualframe: every stage's line (a collective), printed on rank 0
    if hvd.rank() == 0:
        theory = table_bubble(clock_table(rank_schedule(args.schedule, stages, args.chunks)))
        print(f"{args.schedule}, {stages} stages {balance}, chunks {args.chunks}: "
              f"{args.steps * args.batch / elapsed:.0f} samples/s, final loss {loss:.5f}")
        for line in timings:
            print("  " + line)
        print(f"  bubble in theory (the schedule's clock table, equal passes) = {theory:.1%}")


if __name__ == "__main__":
    main()

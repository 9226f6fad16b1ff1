"""GPipe pipeline: an nn.Sequential split over devices, each batch cut into micro-batches so the devices work at once.

    python torch_examples/pipeline.py                                      # visible GPUs, else "cpu" twice
    python torch_examples/pipeline.py --overlap-cpu --timeline gpipe.png   # CPU only: "cpu" stages in threads
    python torch_examples/pipeline.py --devices cuda:0,cuda:1,cuda:2,cuda:3 --chunks 8 --timeline gpipe.png
"""
import argparse
import time

import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.observe.timeline import report


def build(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="comma-separated, one per stage (default: visible GPUs, else cpu)")
    parser.add_argument("--stages", type=int, default=2, help="number of stages when --devices is omitted")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--balance", help="layers per stage (default: by measured time on a micro-batch)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--overlap-cpu", action="store_true",
                        help="run cpu stages in threads so they overlap on a multi-core CPU (default: one after another)")
    parser.add_argument("--timeline", help="write the last step's Gantt chart to this PNG")
    parser.add_argument("--trace", help="write the last step's Chrome trace (chrome://tracing, Perfetto) here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = build(args.width, args.depth)
    devices = args.devices.split(",") if args.devices else None
    stages = len(devices) if devices else args.stages
    sample = torch.randn(args.batch // args.chunks, 16)
    balance = ([int(b) for b in args.balance.split(",")] if args.balance
               else hvd.balance_by_time(model, sample, stages))  # dualframe: even measured time per stage
    pipe = hvd.Pipeline(model, balance, devices, chunks=args.chunks, checkpoint=args.checkpoint,  # dualframe:
                        overlap_cpu=args.overlap_cpu)
    print(f"balance {balance} on {[str(d) for d in pipe.devices]}, chunks {args.chunks}, checkpoint {args.checkpoint}")

    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch + 3, 16, generator=generator)  # 3 extra rows: micro-batches need not be equal
    y = (x[:, :4].sum(1, keepdim=True)).sin().to(pipe.devices[-1])
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        if step == args.steps - 1:
            with pipe.record() as timeline:  # dualframe: each (micro-batch, stage) cell, timed
                loss = nn.functional.mse_loss(pipe(x), y)
                loss.backward()
        else:
            loss = nn.functional.mse_loss(pipe(x), y)
            loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.5f}")
    print(f"{args.steps} steps in {time.perf_counter() - start:.2f} s")
    print(report(timeline.events, trace=args.trace, png=args.timeline))


if __name__ == "__main__":
    main()

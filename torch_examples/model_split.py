"""Model parallelism: an nn.Sequential split into groups of layers on explicit devices (activations move between them).

    python torch_examples/model_split.py                                   # visible GPUs, else "cpu" twice
    python torch_examples/model_split.py --devices cuda:0,cuda:1 --timeline split.png
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
    parser.add_argument("--devices", help="comma-separated, one per group (default: visible GPUs, else cpu)")
    parser.add_argument("--groups", type=int, default=2, help="number of groups when --devices is omitted")
    parser.add_argument("--balance", help="layers per group, e.g. 4,5 (default: even parameter bytes)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeline", help="write the last step's Gantt chart to this PNG")
    parser.add_argument("--trace", help="write the last step's Chrome trace (chrome://tracing, Perfetto) here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = build(args.width, args.depth)
    devices = args.devices.split(",") if args.devices else None
    groups = len(devices) if devices else args.groups
    balance = [int(b) for b in args.balance.split(",")] if args.balance else hvd.balance_by_size(model, groups)  # dualframe:
    split = hvd.ModelParallel(model, balance, devices)  # dualframe: group j on devices[j]
    print(f"balance {balance} on devices {[str(d) for d in split.devices]}")

    optimizer = torch.optim.Adam(split.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 16, generator=generator)
    y = (x[:, :4].sum(1, keepdim=True)).sin().to(split.devices[-1])  # the output lives on the last device
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        if step == args.steps - 1:
            with split.record() as timeline:  # dualframe: forward/backward of each group, timed
                loss = nn.functional.mse_loss(split(x), y)
                loss.backward()
        else:
            loss = nn.functional.mse_loss(split(x), y)
            loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.5f}")
    print(f"{args.steps} steps in {time.perf_counter() - start:.2f} s")
    print(report(timeline.events, trace=args.trace, png=args.timeline))


if __name__ == "__main__":
    main()

"""Any model split over devices: a ResNet (skip connections, BatchNorm) cut as a graph, run as a GPipe pipeline.

dualframe captures the model with torch.fx, chooses where to cut by the time each operation takes on a
sample micro-batch (or cuts at --split-points), and prints the tensors crossing each cut.

    python torch_examples/model_split_resnet.py                               # "cpu" twice, cut chosen
    python torch_examples/model_split_resnet.py --split-points layer2.1 --overlap-cpu
    python torch_examples/model_split_resnet.py --devices cuda:0,cuda:1 --chunks 8 --timeline resnet.png
    mpirun -np 2 python torch_examples/model_split_resnet.py                 # one stage per process
"""
import argparse
import copy
import time

import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.launch.topology import detect
from dualframe.observe.timeline import report


class Block(nn.Module):
    """ResNet basic block: two 3x3 convolutions and a shortcut (a 1x1 convolution where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(Block(width, width), Block(width, width))
        self.layer2 = nn.Sequential(Block(width, 2 * width, 2), Block(2 * width, 2 * width))
        self.layer3 = nn.Sequential(Block(2 * width, 4 * width, 2), Block(4 * width, 4 * width))
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(x.mean((2, 3)))


def synthetic(batch: int, size: int, generator: torch.Generator):
    """Noise images with one brighter quadrant; the label is which quadrant."""
    x = torch.randn(batch, 3, size, size, generator=generator)
    y = torch.randint(0, 4, (batch,), generator=generator)
    half = size // 2
    for k in range(4):
        rows = y == k
        r, c = divmod(k, 2)
        x[rows, :, r * half:(r + 1) * half, c * half:(c + 1) * half] += 1.0
    return x, y


def train_processes(args: argparse.Namespace, model: nn.Module) -> None:
    """One stage per process; every rank cuts alike (named points, or even parameter bytes)."""
    cut = dict(split_points=args.split_points.split(",")) if args.split_points else dict(stages=hvd.size())
    pipe = hvd.DistributedPipeline(model, chunks=args.chunks, loss_fn=nn.functional.cross_entropy, **cut)  # dualframe:
    optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)  # dualframe: the local stage's parameters
    generator = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x, y = synthetic(args.batch, args.size, generator)
        optimizer.zero_grad()
        loss = pipe.train_step(x, y)  # dualframe: images read on stage 0, labels on the last; the mean loss
        optimizer.step()
        if hvd.rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    timings = pipe.timings()  # dualframe: every stage's line (a collective)
    if hvd.rank() == 0:
        view = hvd.ModelParallel(copy.deepcopy(model), devices=["cpu"] * hvd.size(), **cut)  # the same cut, one process
        with torch.no_grad():
            view(synthetic(args.batch // args.chunks, args.size, generator)[0])  # describe() shows what crossed
        print(view.describe())  # dualframe: per boundary, the tensors crossing it (shape, bytes)
        print("\n".join("  " + line for line in timings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu", help="comma-separated, one per stage")
    parser.add_argument("--split-points", help="modules where stages 1.. begin, e.g. layer2.1 (default: chosen)")
    parser.add_argument("--by", default="time", choices=["time", "memory"], help="what the chosen cut evens out")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--size", type=int, default=16, help="image side")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--overlap-cpu", action="store_true", help="run cpu stages in threads so they overlap")
    parser.add_argument("--timeline", help="write the last step's Gantt chart to this PNG")
    parser.add_argument("--trace", help="write the last step's Chrome trace here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if detect().distributed:  # dualframe: launched with -np 2: one stage per process
        hvd.init()  # dualframe:
        return train_processes(args, ResNet(args.width))

    devices = args.devices.split(",")
    generator = torch.Generator().manual_seed(1)
    sample, _ = synthetic(args.batch // args.chunks, args.size, generator)  # one micro-batch
    cut = (dict(split_points=args.split_points.split(",")) if args.split_points
           else dict(stages=len(devices), sample=sample, by=args.by))  # dualframe: cut where time is even
    pipe = hvd.Pipeline(ResNet(args.width), devices=devices, chunks=args.chunks,  # dualframe: any nn.Module
                        overlap_cpu=args.overlap_cpu, **cut)
    print(f"cut points: {pipe.split_points}")  # dualframe: where stages 1.. begin

    optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = synthetic(args.batch, args.size, generator)
        optimizer.zero_grad()
        if step == args.steps - 1:
            with pipe.record() as timeline:  # dualframe: each (micro-batch, stage) cell, timed
                logits = pipe(x)
                loss = nn.functional.cross_entropy(logits, y.to(logits.device))
                loss.backward()
        else:
            logits = pipe(x)
            loss = nn.functional.cross_entropy(logits, y.to(logits.device))
            loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            accuracy = (logits.argmax(1).cpu() == y).float().mean().item()
            print(f"step {step:3d}  loss {loss.item():.4f}  accuracy {accuracy:.2f}")
    print(f"{args.steps} steps in {time.perf_counter() - start:.2f} s")
    print(pipe.describe())  # dualframe: per boundary, the tensors crossing it (shape, bytes)
    print(report(timeline.events, trace=args.trace, png=args.timeline))


if __name__ == "__main__":
    main()

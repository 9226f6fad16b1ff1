"""Synthetic data-parallel benchmark (images/sec per rank and in total), like Horovod's own.

    horovodrun -np 2 -H localhost:2 --gloo python torch_examples/synthetic_benchmark.py --model cnn
    mpirun -np 2 python torch_examples/synthetic_benchmark.py --model mlp --batch-size 32

torchvision is not a dependency, so the models are defined here: ``mlp`` (6.3M parameters on
3x32x32 inputs), ``cnn`` (a small VGG-like network), ``resnet`` (a few residual blocks).
"""
import argparse
import statistics
import timeit

import torch
import torch.nn as nn
import torch.nn.functional as F

import dualframe.torch as hvd  # dualframe


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def build(name: str, classes: int = 10) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1536), nn.ReLU(), nn.Linear(1536, 1024),
                             nn.ReLU(), nn.Linear(1024, classes))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, classes))
    if name == "resnet":
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), Residual(32), Residual(32), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(32, classes))
    raise SystemExit(f"unknown --model {name!r}; choose mlp, cnn or resnet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn", "resnet"])
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--no-allreduce", action="store_true", help="plain optimizer: the no-communication baseline")
    args = parser.parse_args()

    torch.set_num_threads(1)
    hvd.init()  # dualframe
    torch.manual_seed(0)
    model = build(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if not args.no_allreduce:
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),  # dualframe
                                             compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # dualframe
    data, target = torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 10, (args.batch_size,))

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    parameters = sum(p.numel() for p in model.parameters())
    hvd.log(f"model {args.model} ({parameters / 1e6:.1f}M parameters), batch {args.batch_size} per rank, "
            f"{hvd.size()} process(es), allreduce {'off' if args.no_allreduce else 'on'}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        hvd.log(f"iter #{i}: {rates[-1]:.1f} img/sec per rank")
    per_rank = statistics.median(rates)
    total = hvd.allreduce(torch.tensor(per_rank), op=hvd.Sum, name="img_sec").item()  # dualframe
    hvd.log(f"img/sec per rank: {per_rank:.1f} (median of {args.num_iters}); total on {hvd.size()}: {total:.1f}")


if __name__ == "__main__":
    main()

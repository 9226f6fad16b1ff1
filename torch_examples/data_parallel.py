"""Data parallelism in PyTorch: an ordinary training script plus the lines marked ``# dualframe:``.

Runs unchanged on one process or many:

    python torch_examples/data_parallel.py --epochs 2
    horovodrun -np 2 -H localhost:2 --gloo python torch_examples/data_parallel.py --epochs 2
    mpirun -np 2 python torch_examples/data_parallel.py --epochs 2

The data is generated: 10 classes of points around random centres in 32 dimensions, with noise.
"""
import argparse
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import dualframe.torch as hvd  # dualframe: Horovod's API (import horovod.torch as hvd works the same)


def make_data(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)  # the same class centres for training and test data
    centres = torch.randn(10, 32, generator=g)
    g.manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=g)
    points = centres[labels] + torch.randn(samples, 32, generator=g) * 1.6
    return TensorDataset(points, labels)


def evaluate(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    sampler = hvd.distributed_sampler(data, shuffle=False)  # dualframe: each rank scores its shard
    correct = total = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=256, sampler=sampler):
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    return hvd.metric_average(correct / max(total, 1), name="accuracy")  # dualframe: mean over ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="one-process learning rate")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--fp16-allreduce", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    hvd.init()  # dualframe: start Horovod
    torch.manual_seed(1234 + hvd.rank())
    train, test = make_data(args.samples, seed=1), make_data(2048, seed=2)
    sampler = hvd.distributed_sampler(train, shuffle=True, seed=0)  # dualframe: this rank's shard
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = hvd.warmup_lr_scheduler(optimizer, warmup_steps=len(loader))  # dualframe: lr x size, warmed up
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),  # dualframe
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # dualframe: everyone starts from rank 0
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # dualframe

    hvd.log(f"training on {hvd.size()} process(es), {args.batch_size} rows each per step")  # dualframe
    loss_fn = nn.CrossEntropyLoss()
    start, rows = time.perf_counter(), 0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)  # dualframe: a new shuffle each epoch, the same on every rank
        for x, y in hvd.progress(loader, desc=f"epoch {epoch + 1}"):  # dualframe: bar on rank 0
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            rows += len(y)
        loss_avg = hvd.metric_average(loss.item(), name="loss")  # dualframe
        hvd.log(f"epoch {epoch + 1}: last loss {loss_avg:.4f}, lr {optimizer.param_groups[0]['lr']:.3f}")
    elapsed = time.perf_counter() - start
    accuracy = evaluate(model, test)
    total_rows = hvd.allreduce(torch.tensor(float(rows)), op=hvd.Sum, name="rows").item()  # dualframe
    hvd.log(f"throughput: {rows / elapsed:.0f} samples/s per rank, {total_rows / elapsed:.0f} samples/s in total")
    hvd.log(f"final test accuracy: {accuracy:.3f}")


if __name__ == "__main__":
    main()

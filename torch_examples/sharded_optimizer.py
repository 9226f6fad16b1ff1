"""A sharded optimizer (ZeRO-1/2) in PyTorch: data parallelism where each rank keeps 1/N of the Adam state.

The training script is ordinary data parallelism plus one argument, ``shard=``:

    horovodrun -np 2 -H localhost:2 --gloo python torch_examples/sharded_optimizer.py --epochs 2
    mpirun -np 2 python torch_examples/sharded_optimizer.py --shard optimizer

Each rank prints nothing but rank 0: the loss falling, the Adam state bytes this rank holds against
what plain data parallelism would hold, and a checkpoint gathered in the plain optimizer's format.
The data is generated: a residual MLP learns y = sin(x W) from noisy samples.
"""
import argparse
import time

import torch
import torch.nn as nn

import dualframe.torch as hvd  # dualframe: Horovod's API plus shard=


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(self.norm(x)))


def make_data(samples: int, seed: int) -> "tuple[torch.Tensor, torch.Tensor]":
    g = torch.Generator().manual_seed(0)  # the same target function on every rank
    w = torch.randn(32, 8, generator=g) / 4
    g.manual_seed(seed)
    x = torch.randn(samples, 32, generator=g)
    return x, torch.sin(x @ w) + 0.05 * torch.randn(samples, 8, generator=g)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--shard", choices=("optimizer", "gradients"), default="gradients",
                        help="optimizer: ZeRO-1 (state / N); gradients: ZeRO-2 (state and gradients / N)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    hvd.init()  # dualframe: start Horovod
    torch.manual_seed(1234)  # the same model everywhere (broadcast below makes sure)
    model = nn.Sequential(nn.Linear(32, args.width), *[Block(args.width) for _ in range(args.blocks)],
                          nn.Linear(args.width, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),  # dualframe
                                         shard=args.shard)  # dualframe: each rank keeps 1/N of the state
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)  # reaches the slices
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # dualframe: everyone starts from rank 0

    x, y = make_data(8192, seed=1 + hvd.rank())  # dualframe: each rank its own samples
    x_test, y_test = make_data(1024, seed=999)
    parameters = sum(p.numel() for p in model.parameters())
    hvd.log(f"{parameters / 1e6:.2f} M parameters, shard={args.shard!r} over {hvd.size()} process(es)")  # dualframe
    with torch.no_grad():
        hvd.log(f"test loss before training: {nn.functional.mse_loss(model(x_test), y_test).item():.4f}")
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in hvd.progress(range(0, len(x), args.batch_size), desc=f"epoch {epoch + 1}"):  # dualframe
            rows = order[i:i + args.batch_size]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            loss.backward()
            optimizer.step()  # dualframe: reduce-scatter, step this rank's slice, allgather
            scheduler.step()
        loss_avg = hvd.metric_average(loss.item(), name="loss")  # dualframe: mean over ranks
        hvd.log(f"epoch {epoch + 1}: last loss {loss_avg:.4f}, lr {optimizer.param_groups[0]['lr']:.5f}")
    elapsed = time.perf_counter() - start

    mine = state_bytes(optimizer)  # this rank's slices only
    plain = 2 * 4 * parameters  # Adam's two float32 slots for every parameter
    hvd.log(f"Adam state on this rank: {mine / 2**20:.2f} MiB, plain data parallelism: {plain / 2**20:.2f} MiB "
            f"({mine / plain:.2f} of it)")
    full = optimizer.state_dict()  # dualframe: every rank calls it (it gathers the slices)
    if hvd.is_root():
        torch.save({"model": model.state_dict(), "optimizer": full}, "/tmp/sharded_optimizer.pt")
        restored = torch.optim.AdamW(model.parameters(), lr=args.lr)
        restored.load_state_dict(full)  # the plain optimizer's format: loadable without sharding
        hvd.log(f"checkpoint /tmp/sharded_optimizer.pt: {len(full['state'])} parameters' state, loads into plain AdamW")
    with torch.no_grad():
        hvd.log(f"test loss after training: {nn.functional.mse_loss(model(x_test), y_test).item():.4f} "
                f"({elapsed:.1f} s)")


if __name__ == "__main__":
    main()

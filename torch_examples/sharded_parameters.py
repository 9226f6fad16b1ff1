"""Sharded parameters (ZeRO-3) in PyTorch: each rank keeps 1/N of the weights, gradients and Adam state.

The training script is ordinary data parallelism through ``distribute`` with ``shard="parameters"``:

    horovodrun -np 2 -H localhost:2 --gloo python torch_examples/sharded_parameters.py --epochs 2
    mpirun -np 2 python torch_examples/sharded_parameters.py

Rank 0 prints the loss falling, the bytes this rank holds against plain data parallelism, and a
checkpoint gathered in the plain model's format that loads into the model without dualframe.
The data is generated: a residual MLP learns y = sin(x W) from noisy samples.
"""
import argparse
import copy

import torch
import torch.nn as nn

import dualframe
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


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, slices, their gradients and Adam state this rank holds now."""
    slices = [p for g in optimizer.inner.param_groups for p in g["params"]]
    tensors = [p for p in model.parameters()] + slices + [p.grad for p in slices if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(32, args.width), *[Block(args.width) for _ in range(args.blocks)],
                          nn.Linear(args.width, 8))
    plain = copy.deepcopy(model)  # to show the checkpoint loads into the unsharded model
    model, optimizer = hvd.distribute(model, torch.optim.Adam(model.parameters(), lr=args.lr),  # dualframe
                                      dualframe.DataParallel(shard="parameters"))  # dualframe: 1/N of everything
    x, y = make_data(8192, seed=1 + hvd.rank())  # dualframe: each rank its own samples
    x_test, y_test = make_data(1024, seed=999)
    parameters = sum(p.numel() for p in plain.parameters())
    hvd.log(f"{parameters / 1e6:.2f} M parameters, shard='parameters' over {hvd.size()} process(es)")  # dualframe
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in hvd.progress(range(0, len(x), args.batch_size), desc=f"epoch {epoch + 1}"):  # dualframe
            rows = order[i:i + args.batch_size]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])  # dualframe: each block gathered in turn
            loss.backward()  # dualframe: gathered again, gradients reduced into each rank's slices
            optimizer.step()  # dualframe: steps this rank's slices only
        loss_avg = hvd.metric_average(loss.item(), name="loss")  # dualframe: mean over ranks
        hvd.log(f"epoch {epoch + 1}: last loss {loss_avg:.4f}")
    mine = held_bytes(model, optimizer)
    hvd.log(f"weights+gradients+Adam on this rank: {mine / 2**20:.2f} MiB, plain data parallelism: "
            f"{16 * parameters / 2**20:.2f} MiB ({mine / (16 * parameters):.2f} of it)")
    full = optimizer.model_state_dict()  # dualframe: every rank calls it (it gathers the blocks)
    if hvd.is_root():
        torch.save(full, "/tmp/sharded_parameters.pt")
        plain.load_state_dict(torch.load("/tmp/sharded_parameters.pt"))  # a plain model, no dualframe
        with torch.no_grad():
            hvd.log(f"checkpoint /tmp/sharded_parameters.pt loads into the plain model: test loss "
                    f"{nn.functional.mse_loss(plain(x_test), y_test).item():.4f}")


if __name__ == "__main__":
    main()

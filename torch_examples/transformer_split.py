"""A Transformer encoder taking (tokens, padding mask), its residual blocks each reading the mask, split in two.

One process: a GPipe Pipeline over two devices. Under a launcher: a DistributedPipeline, one stage per
process; rank 0 times the model on a sample, chooses the cut and tells the other ranks. The task: is the
marker token among the real tokens? Padding holds random tokens too (the marker sometimes), so only a
model that reads the mask can learn it.

    python torch_examples/transformer_split.py                                 # "cpu" twice, cut chosen
    python torch_examples/transformer_split.py --split-points blocks.1 --devices cuda:0,cuda:1
    mpirun -np 2 python torch_examples/transformer_split.py --chunks 8
"""
import argparse
import copy
import time

import torch
from torch import nn

import dualframe.torch as hvd
from dualframe.launch.topology import detect
from dualframe.observe.timeline import report

MARKER, VOCAB = 1, 32


class Block(nn.Module):
    """Pre-norm residual block: self-attention that skips the padding, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = self.norm1(h)
        h = h + self.attention(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        return h + self.mlp(self.norm2(h))


class Encoder(nn.Module):
    def __init__(self, dim: int, heads: int, blocks: int, length: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, dim), nn.Parameter(0.02 * torch.randn(length, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        for block in self.blocks:
            h = block(h, pad)  # every block reads the mask: it crosses to every stage
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))  # mean over the real tokens only


def synthetic(batch: int, length: int, generator: torch.Generator):
    """Tokens of varying length (pad=True past it); label 1 when the marker is among the real tokens."""
    tokens = torch.randint(2, VOCAB, (batch, length), generator=generator)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=generator)
    pad = torch.arange(length)[None, :] >= lengths[:, None]
    y = torch.randint(0, 2, (batch,), generator=generator)
    where = (torch.rand(batch, generator=generator) * lengths).long()
    tokens[y == 1, where[y == 1]] = MARKER
    decoy = (torch.rand(batch, generator=generator) < 0.5) & (lengths < length)  # a marker in the padding
    spot = (lengths + torch.rand(batch, generator=generator) * (length - lengths)).long()
    tokens[decoy, spot[decoy]] = MARKER
    return tokens, pad, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu,cpu", help="one process: comma-separated, one per stage")
    parser.add_argument("--split-points", help="modules where stages 1.. begin, e.g. blocks.1 (default: timed)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per process: the stages share the cores
    processes = detect().distributed  # dualframe: launched with -np 2: one stage per process
    if processes:
        hvd.init()  # dualframe:
    rank = hvd.rank() if processes else 0  # dualframe:
    torch.manual_seed(0)  # every rank builds the same model, then keeps its stage
    model = Encoder(args.dim, args.heads, args.blocks, args.length)
    generator = torch.Generator().manual_seed(1)
    tokens, pad, _ = synthetic(args.batch // args.chunks, args.length, generator)  # one micro-batch
    cut = (dict(split_points=args.split_points.split(",")) if args.split_points
           else dict(stages=2, sample=(tokens, pad)))  # dualframe: cut where forward time is even

    if processes:  # timings differ between ranks: rank 0 measures, every rank cuts where it says
        plan = hvd.ModelParallel(copy.deepcopy(model), devices=["cpu", "cpu"], **cut) if rank == 0 else None
        if plan is not None:
            with torch.no_grad():
                plan(tokens, pad)  # one micro-batch: describe() shows what crosses, with sizes
        # dualframe: a name every rank agrees on (Horovod's default is the object's type: list here, None there)
        split_points = hvd.broadcast_object(plan and list(plan.split_points), root_rank=0, name="cut")
        pipe = hvd.DistributedPipeline(model, chunks=args.chunks, loss_fn=nn.functional.cross_entropy,  # dualframe:
                                       split_points=split_points)
    else:
        pipe = plan = hvd.Pipeline(model, devices=args.devices.split(","), chunks=args.chunks, **cut)  # dualframe:
        split_points = list(pipe.split_points)
    if rank == 0:
        print(f"cut points: {split_points}")  # dualframe: where stage 1 begins
    optimizer = torch.optim.Adam(pipe.parameters(), lr=2e-3)  # processes: the local stage's parameters
    test = synthetic(args.batch, args.length, torch.Generator().manual_seed(2))

    def accuracy() -> float:
        with torch.no_grad():
            logits = pipe((test[0], test[1])) if processes else pipe(test[0], test[1])  # dualframe:
        value = (logits.argmax(1).cpu() == test[2]).float().mean().item() if logits is not None else None
        if not processes:
            return value
        return hvd.broadcast_object(value, root_rank=hvd.size() - 1, name="accuracy")  # dualframe: the last stage's

    start, timeline = time.perf_counter(), None
    for step in range(args.steps):
        tokens, pad, y = synthetic(args.batch, args.length, generator)
        optimizer.zero_grad()
        if processes:
            loss = pipe.train_step((tokens, pad), y)  # dualframe: inputs read on stage 0, labels on the last
        else:
            with pipe.record() as timeline:  # dualframe: each (micro-batch, stage) cell, timed; the last step's kept
                loss_t = nn.functional.cross_entropy(pipe(tokens, pad), y)
                loss_t.backward()
            loss = loss_t.item()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            held_out = accuracy()
            if rank == 0:
                print(f"step {step:3d}  loss {loss:.4f}  held-out accuracy {held_out:.2f}", flush=True)
    elapsed = time.perf_counter() - start

    timings = pipe.timings() if processes else None  # dualframe: every stage's line (a collective)
    if rank == 0:
        print(f"{args.steps} steps in {elapsed:.2f} s (accuracy checks included), chunks {args.chunks}")
        print(plan.describe())  # dualframe: per boundary, the tensors crossing it (shape, bytes)
        print("\n".join("  " + line for line in timings) if timings else report(timeline.events))


if __name__ == "__main__":
    main()

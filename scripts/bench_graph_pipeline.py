"""Benchmark of a graph split over two process stages: the Transformer example (tokens, padding mask) cut at one block.

    mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none -x OMP_NUM_THREADS=1 -x PATH -x PYTHONPATH \\
        .venv/bin/python scripts/bench_graph_pipeline.py

The encoder of torch_examples/transformer_split.py, cut where blocks.<blocks/2> begins. From interleaved rounds
(A B C A B C ..., median of the per-round ratios) it prints the throughput of dualframe's graph
DistributedPipeline with chunks=8 over chunks=1, and of torch.distributed.pipelining splitting the same
module with its own tracer (``pipeline(module, mb_args, split_spec={point: SplitPoint.BEGINNING})``,
torch.export underneath) run by ScheduleGPipe over gloo with 8 micro-batches, over the same chunks=1, and
the two pipelines head to head. That tracer (``--torch-split tracer``) traces and builds both stages, but
stage 1 reads the mask, a model input, and its first step stops there (torch 2.13): ``PipeliningMetadataError:
_retrieve_recv_activations expected non-root _RecvInfo but got root arg at index 1`` (only stage 0 may read
model inputs). So by default a manual split of the same modules stands in (stage 0 returns (h, mask)).
"""
import os

import torch
from torch import nn

import bench_common
import dualframe
import dualframe.torch as hvd
from dualframe.observe.bench_rounds import ratio_line, seconds_line
from dualframe.torch.pipeline.distributed import DistributedPipeline
from torch_examples.transformer_split import Encoder, synthetic


def ours(model, chunks, point):
    pipe = DistributedPipeline(model, chunks=chunks, loss_fn=nn.functional.cross_entropy, split_points=[point])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-4)

    def step(tokens, pad, y):
        optimizer.zero_grad()
        pipe.train_step((tokens, pad), y)
        optimizer.step()
    return step


class Front(nn.Module):
    """The manual split's stage 0: embedding and the first blocks; passes the mask on."""

    def __init__(self, model, half):
        super().__init__()
        self.embed, self.position, self.blocks = model.embed, model.position, model.blocks[:half]

    def forward(self, tokens, pad):
        h = self.embed(tokens) + self.position
        for block in self.blocks:
            h = block(h, pad)
        return h, pad


class Back(nn.Module):
    def __init__(self, model, half):
        super().__init__()
        self.blocks, self.head = model.blocks[half:], model.head

    def forward(self, h, pad):
        for block in self.blocks:
            h = block(h, pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))


def torch_gpipe(model, chunks, point, sample, rank, split):
    """torch.distributed.pipelining at the same cut: its tracer, or a manual split of the same modules."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, SplitPoint, pipeline

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29534")
        dist.init_process_group("gloo", rank=rank, world_size=2)
    if split == "tracer":
        pipe = pipeline(model, mb_args=sample, split_spec={point: SplitPoint.BEGINNING})
        stage, how = pipe.build_stage(rank, torch.device("cpu")), "its tracer (pipeline(), torch.export)"
        part = stage.submod
    else:
        half = int(point.split(".")[1])
        part = Front(model, half) if rank == 0 else Back(model, half)
        stage = PipelineStage(part, stage_index=rank, num_stages=2, device=torch.device("cpu"))
        how = "a manual split (Front/Back modules, the mask passed along)"
    schedule = ScheduleGPipe(stage, n_microbatches=chunks, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(part.parameters(), lr=1e-4)

    def step(tokens, pad, y):
        optimizer.zero_grad()
        try:
            schedule.step(tokens, pad) if rank == 0 else schedule.step(target=y, losses=[])
        except Exception as error:  # printed here: otherwise the rank exits 1 with no traceback under mpirun
            print(f"rank {rank}: ScheduleGPipe.step failed: {type(error).__name__}: {error}", flush=True)
            raise
        optimizer.step()
    return step, how


def main() -> None:
    parser = bench_common.parser(__doc__, dim=64, heads=4, blocks=4, length=32, batch=256, rounds=7, steps=3)
    parser.add_argument("--torch-split", default="manual", choices=["tracer", "manual"],
                        help="how torch.distributed.pipelining cuts (its tracer fails here: see above)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench_common.init_two_processes(hvd)
    rank, point = dualframe.detect_topology().rank, f"blocks.{args.blocks // 2}"
    batch = synthetic(args.batch, args.length, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = Encoder(args.dim, args.heads, args.blocks, args.length)
    sample = (batch[0][:args.batch // 8], batch[1][:args.batch // 8])
    theirs, how = torch_gpipe(model, 8, point, sample, rank, args.torch_split)
    configs = {"chunks=1": ours(model, 1, point), "chunks=8": ours(model, 8, point), "torch ScheduleGPipe m=8": theirs}
    for step in configs.values():  # warm-up: allocator, autograd, shape headers
        step(*batch)
    times = bench_common.interleaved_steps(configs, batch, args.steps, args.rounds, hvd.barrier)
    report = [ratio_line(f"{name} / chunks=1", times["chunks=1"], times[name])
              for name in ("chunks=8", "torch ScheduleGPipe m=8")]
    report.append(ratio_line("chunks=8 / torch ScheduleGPipe m=8", times["torch ScheduleGPipe m=8"], times["chunks=8"]))
    report.append(seconds_line(times))
    header = (f"Encoder(dim {args.dim}, heads {args.heads}, {args.blocks} blocks, length {args.length}), batch "
              f"{args.batch}, cut at {point}, 2 process stages, 1 thread each, {args.rounds} rounds of {args.steps} "
              f"steps; torch.distributed.pipelining: {how}")
    bench_common.print_report(hvd.rank(), header, report)


if __name__ == "__main__":
    main()

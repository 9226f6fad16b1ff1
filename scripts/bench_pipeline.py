"""Benchmarks of the one-process model split and GPipe pipeline (torch); prints ratios measured in one run.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_pipeline.py   # the profiler logs to stderr

1. overhead: Pipeline with every group on the same device vs the plain module, same batch, A B rounds
   interleaved, median ratio of step times (goal <= 1.10), in process CPU time (robust to a loaded
   machine) and wall time; beside it the plain module accumulating 4 micro-batches (what micro-batching
   itself costs) and the Pipeline with overlap_cpu=True (cpu stages in threads: the hand-off cost);
2. memory: peak activation memory of a deep MLP step with checkpoint="always" vs "never": the peak of
   the bytes allocated during one step (after a warm-up that made the grads), from torch's profiler
   record of every allocation and free (peak RSS, used before, moved with the allocator's arenas);
3. bubble: stages that sleep a fixed time in forward and backward (overlap_cpu=True: "cpu" stages overlap):
   the timeline's measured bubble vs (n-1)/(m+n-1) (goal: within 5 points).
"""
import argparse
import os
import statistics
import time

import bench_env

bench_env.one_thread_per_process(tensorflow=False)

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_common  # noqa: E402
import dualframe.torch as hvd  # noqa: E402
from bench_torch import linear_relu  # noqa: E402
from dualframe.observe.timeline import measured_bubble  # noqa: E402
from dualframe.pipeline.clock import gpipe_bubble# noqa: E402


def step_time(model: nn.Module, x: torch.Tensor, steps: int, chunks: int = 1) -> "tuple[float, float]":
    """(wall seconds, process CPU seconds) per step; chunks > 1 on a plain module = gradient accumulation."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        for part in x.chunk(chunks):
            (model(part).square().mean() / chunks).backward()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def overhead(args: argparse.Namespace) -> None:
    plain = linear_relu(args.width, args.depth)
    x = torch.randn(args.batch, args.width)
    half = args.depth  # layers per group: the 2 * depth layers cut in two
    variants = {f"Pipeline(chunks={c}{', overlap_cpu=True' if o else ''})":
                (hvd.Pipeline(linear_relu(args.width, args.depth), [half, half], ["cpu", "cpu"], chunks=c,
                              checkpoint="never", overlap_cpu=o), 1)
                for c, o in ((1, False), (4, False), (4, True))}
    variants["plain module, 4 micro-batches accumulated"] = (plain, 4)
    for model, chunks in [(plain, 1), *variants.values()]:
        step_time(model, x, 2, chunks)  # warm-up
    ratios: dict = {name: ([], []) for name in variants}
    for r in range(args.rounds):
        for name, (model, chunks) in variants.items():
            base_first = r % 2 == 0
            first = step_time(plain, x, args.steps) if base_first else step_time(model, x, args.steps, chunks)
            second = step_time(model, x, args.steps, chunks) if base_first else step_time(plain, x, args.steps)
            base, other = (first, second) if base_first else (second, first)
            ratios[name][0].append(other[0] / base[0])
            ratios[name][1].append(other[1] / base[1])
    print(f"[overhead] MLP {args.depth} x (Linear({args.width}, {args.width}), ReLU), batch {args.batch}, "
          f"2 groups both on cpu, checkpoint=never, one thread, {args.rounds} interleaved A/B rounds x "
          f"{args.steps} steps; ratio of step time to the plain module on the same batch (median)")
    medians = {}
    for name, (wall, cpu) in ratios.items():
        medians[name] = statistics.median(cpu)
        print(f"  {name}: CPU time {medians[name]:.3f} (rounds {', '.join(f'{v:.2f}' for v in cpu)}); "
              f"wall {statistics.median(wall):.3f} (rounds {', '.join(f'{v:.2f}' for v in wall)})")
    inherent = medians["plain module, 4 micro-batches accumulated"]
    print(f"  Pipeline(chunks=4) beyond micro-batching itself (CPU medians): "
          f"{medians['Pipeline(chunks=4)'] / inherent:.3f}")


def step_peak_mib(model: nn.Module, x: torch.Tensor) -> float:
    """Peak of the bytes held by tensors allocated during one step, from the profiler's record of every
    allocation and free of torch's CPU allocator (what the step adds to what was there before)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x).square().mean().backward()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak / 2 ** 20


def memory(args: argparse.Namespace) -> None:
    width, depth, batch, chunks = 1024, 16, 2048, 8
    activations = 2 * depth * batch * width * 4 / 2 ** 20
    peaks = {}
    for mode in ("never", "always", "except_last"):
        model = hvd.Pipeline(linear_relu(width, depth), [depth, depth], ["cpu", "cpu"], chunks=chunks, checkpoint=mode)
        model(torch.randn(chunks, width)).sum().backward()  # warm-up: allocates the gradients
        peaks[mode] = step_peak_mib(model, torch.randn(batch, width))
    print(f"[memory] MLP {2 * depth} layers x width {width}, batch {batch}, chunks {chunks}, 2 stages; peak of the "
          f"memory allocated during one step (torch profiler, profile_memory; all layer outputs of the batch: "
          f"{activations:.0f} MiB)")
    for mode, peak in peaks.items():
        print(f"  checkpoint={mode}: {peak:.0f} MiB")
    print(f"  always / never: {peaks['always'] / peaks['never']:.3f}; except_last / never: "
          f"{peaks['except_last'] / peaks['never']:.3f}")


class SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, seconds):  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * scale

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, grad.sum() * 0, None


class Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.scale = seconds, nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepFn.apply(x, self.scale, self.seconds)


def bubble(args: argparse.Namespace) -> None:
    print(f"[bubble] stages sleeping {args.cell_ms} ms per cell (forward and backward), median of {args.rounds} steps")
    for m, n in ((4, 2), (8, 4), (16, 4), (4, 4)):
        pipe = hvd.Pipeline(nn.Sequential(*[Sleep(args.cell_ms / 1000) for _ in range(n)]), [1] * n, ["cpu"] * n,
                            chunks=m, checkpoint="never", overlap_cpu=True)
        measured = []
        for _ in range(args.rounds):
            with pipe.record() as timeline:
                pipe(torch.ones(m, 2)).sum().backward()
            measured.append(measured_bubble(timeline.events))
        value, theory = statistics.median(measured), gpipe_bubble(stages=n, chunks=m)
        print(f"  m={m:2d} n={n}: measured {value:.3f}, theoretical {theory:.3f}, "
              f"difference {100 * (value - theory):+.1f} points")


def main() -> None:
    parser = bench_common.parser(__doc__, helps={"depth": "Linear+ReLU pairs (overhead: half per group)"},
                                 width=512, depth=12, batch=2048, steps=2, rounds=7, cell_ms=20.0)
    parser.add_argument("--only", choices=["overhead", "memory", "bubble"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    for name, run in (("overhead", overhead), ("memory", memory), ("bubble", bubble)):
        if args.only in (None, name):
            run(args)


if __name__ == "__main__":
    main()

"""torch's one-process Pipeline on a chain before and after the chain ran as a graph: a base checkout's chain step against this one's.

    mkdir -p /tmp/onepath-base && git archive 493c600 dualframe | tar -x -C /tmp/onepath-base   # the last chain step
    .venv/bin/python scripts/bench_onepath.py --base /tmp/onepath-base

One process, one thread. The same ``hvd.Pipeline`` (this checkout's, 2 or 4 stages all on "cpu") steps two
ways: ``chain``, the base's ``dualframe/torch/split/run.py`` (``StepRun`` + ``PipeFunction``, the cells
passing one tensor) driven as the base's ``ModelParallel.forward`` drove it; ``graph``, ``pipe(x)``, the
chain as a graph whose edges are (j - 1, j) (``graph.run.StepRun``). A step: zero the gradients, forward,
``square().mean().backward()``. Interleaved rounds, the order flipped every round; per model the median
CPU seconds (``time.process_time``, which holds while other jobs load the box) and wall seconds per step,
and the median of the per-round ratios graph / chain.
"""
import argparse
import importlib.util
import pathlib
import statistics
import time
from typing import Any, Callable, Dict, List

import bench_env

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--base", type=pathlib.Path, required=True, help="a checkout holding dualframe/torch/split/run.py")
ARGS.add_argument("--rounds", type=int, default=11)
ARGS.add_argument("--steps", type=int, default=2, help="steps per arm per round, at least (more for fast steps)")
ARGS.add_argument("--checkpoint", default="except_last", choices=["never", "always", "except_last"])


def models() -> Dict[str, Any]:
    """name -> (model, balance, batch, chunks, input width): the issue's dense stack, a small residual net, and
    stages that compute nothing, where the step's own bookkeeping is all there is to time."""
    import torch
    from torch import nn

    from bench_torch import linear_relu

    class Residual(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x + self.body(x))

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    torch.manual_seed(0)
    residual = nn.Sequential(*[Residual(128) for _ in range(8)])
    return {"12 x (Linear(512), ReLU), batch 2048, chunks 8, 2 stages": (linear_relu(512, 12), [12, 12], 2048, 8, 512),
            "8 residual blocks of 2 x Linear(128), batch 256, chunks 8, 4 stages": (residual, [2, 2, 2, 2], 256, 8, 128),
            "4 x (x * w), batch 32, chunks 32, 4 stages (no compute: the step's own cost, 256 cells)":
                (nn.Sequential(*[Scale() for _ in range(4)]), [1, 1, 1, 1], 32, 32, 4)}


def base_step(base: Any, pipe: Any) -> Callable[[Any], Any]:
    """The base checkout's chain forward (its ``ModelParallel.forward`` for a Sequential) on ``pipe``'s partitions."""
    import torch

    from dualframe.pipeline.microbatch import micro_batch_sizes

    def forward(batch: Any) -> Any:
        sizes = micro_batch_sizes(int(batch.shape[0]), pipe.plan.chunks)
        pipe._begin_step(int(batch.shape[0]))
        params = [list(stage.parameters()) for stage in pipe.partitions]
        flat = base.unique_params(params)
        run = base.StepRun(list(pipe.partitions), pipe.devices, pipe.plan, torch.split(batch, sizes), params,
                           pipe.recorder(pipe.plan.devices), pipe._lanes())
        try:
            return base.PipeFunction.apply(run, batch, *flat)
        finally:
            pipe._end_forward()
    return forward


def timed(forward: Callable[[Any], Any], pipe: Any, x: Any, steps: int) -> "tuple[float, float]":
    """(CPU seconds, wall seconds) per step."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        pipe.zero_grad(set_to_none=True)
        forward(x).square().mean().backward()
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def main() -> None:
    args = ARGS.parse_args()
    bench_env.one_thread_per_process(tensorflow=False)
    import torch

    import dualframe.torch as hvd
    spec = importlib.util.spec_from_file_location("base_run", args.base.resolve() / "dualframe/torch/split/run.py")
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, checkpoint={args.checkpoint}, {args.rounds} rounds, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    for name, (model, balance, batch, chunks, width) in models().items():
        pipe = hvd.Pipeline(model, balance, ["cpu"] * len(balance), chunks=chunks, checkpoint=args.checkpoint)
        x = torch.randn(batch, width)
        arms = {"chain": base_step(base, pipe), "graph": pipe}
        warm = max(timed(forward, pipe, x, 1)[0] for forward in arms.values())
        steps = max(args.steps, int(0.5 / warm))  # a round's block at least about half a second
        times: Dict[str, List["tuple[float, float]"]] = {arm: [] for arm in arms}
        for r in range(args.rounds):
            for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                times[arm].append(timed(arms[arm], pipe, x, steps))
        print(f"{name}, {steps} steps a round")
        for k, unit in ((0, "CPU"), (1, "wall")):
            ratios = [g[k] / c[k] for g, c in zip(times["graph"], times["chain"])]
            medians = {arm: statistics.median(t[k] for t in ts) for arm, ts in times.items()}
            print(f"  {unit} s per step (median): chain {medians['chain']:.4f}, graph {medians['graph']:.4f}; "
                  f"graph / chain median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()

"""Benchmark of the hybrid (2 replicas x 2 stages) with shard=None, "gradients" and "parameters": bytes and step time, one run.

    flock /tmp/dualframe-mp.lock mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1 \\
        .venv/bin/python scripts/bench_zero3_hybrid.py [--framework keras]

``--framework keras``: the same measurement of a Keras pipeline (``bench_zero3_hybrid_keras.py``).

Every rank builds the three pipelines of the same model (an MLP of ``--depth`` Linear(width, width)
+ Tanh layers, Adam, 1F1B, ``--chunks`` micro-batches) and trains them in turn, one step each per
round (A B C A B C ...); rank 0 prints, per mode, the bytes each rank holds for its stage's weights
(the storage of parameters, gradients, slices and Adam state, each storage once; the most over the
ranks) between steps and at the stage's forwards in a step (the most; the hooks' counting is inside
the timed step, alike for every mode), their ratio to ``shard=None``, and the median over rounds of
each round's step-time ratio to ``shard=None``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

import bench_env

MODES = (None, "gradients", "parameters")


def build(args: argparse.Namespace, shard: Any) -> Any:
    """A hybrid pipeline of the benchmark's model and its optimizer with ``shard``."""
    import torch
    from torch import nn

    import dualframe.torch as hvd
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    half = len(layers) // 2
    pipe = hvd.DistributedPipeline(nn.Sequential(*layers), [half, len(layers) - half], chunks=args.chunks,
                                   schedule="1f1b", loss_fn=nn.MSELoss(), data_parallel=2)
    return pipe, pipe.distributed_optimizer(torch.optim.Adam(pipe.parameters(), lr=1e-4), shard=shard)


def step(pipe: Any, optimizer: Any, x: Any, held: Dict[str, int]) -> float:
    """One timed step; the bytes held at the stage's forwards (the most) and after ``zero_grad``."""
    from bench_zero3_torch import holding
    forwards: List[int] = []
    hook = pipe.stage.register_forward_pre_hook(lambda *_: forwards.append(holding(pipe, optimizer)))
    start = time.perf_counter()
    pipe.train_step(x, x)
    optimizer.step()
    optimizer.zero_grad()
    elapsed = time.perf_counter() - start
    hook.remove()
    held["in step"], held["between"] = max(forwards), holding(pipe, optimizer)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64, help="rows per replica")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--framework", choices=("torch", "keras"), default="torch")
    args = parser.parse_args()
    bench_env.one_thread_per_process(tensorflow=args.framework == "keras")  # before the framework loads
    if args.framework == "keras":
        from bench_zero3_hybrid_keras import run
        run(args)
    else:
        run_torch(args)


def run_torch(args: argparse.Namespace) -> None:
    """The torch arm: every rank trains the three pipelines in turn; rank 0 prints."""
    import torch

    import dualframe.torch as hvd
    from dualframe.pipeline.layout import pipeline_process_sets
    hvd.init(process_sets=pipeline_process_sets(4, 2))
    runs = {mode: build(args, mode) for mode in MODES}
    title = f"torch hybrid 2 x 2, {args.depth} x Linear({args.width})"
    rounds(args, runs, step, torch.randn(args.batch_size, args.width), hvd, title)


def rounds(args: argparse.Namespace, runs: Dict[Any, Any], step: Any, x: Any, hvd: Any, title: str) -> None:
    """Each mode's one ``step`` per round, A B C ... (round 0 warms up); rank 0 prints the bytes and time ratios."""
    held: Dict[Any, Dict[str, int]] = {mode: {} for mode in MODES}
    times: Dict[Any, List[float]] = {mode: [] for mode in MODES}
    for r in range(args.rounds + 1):  # round 0 warms up (first allocations, the transport's first messages)
        for mode in MODES:
            seconds = step(*runs[mode], x, held[mode])
            if r:
                times[mode].append(seconds)
    every = hvd.allgather_object(held)
    if hvd.rank() == 0:
        plain = {when: max(h[None][when] for h in every) for when in ("between", "in step")}
        print(f"{title}, Adam, 1f1b, chunks {args.chunks}, {args.batch_size} rows per replica, {args.rounds} rounds")
        for mode in MODES:
            most = {when: max(h[mode][when] for h in every) for when in ("between", "in step")}
            ratio = statistics.median(t / p for t, p in zip(times[mode], times[None]))
            print(f"  shard={mode!r:13} between steps {most['between'] / 2**20:7.1f} MiB "
                  f"({most['between'] / plain['between']:.2f})  in step {most['in step'] / 2**20:7.1f} MiB "
                  f"({most['in step'] / plain['in step']:.2f})  step time x{ratio:.2f}  "
                  f"(median {statistics.median(times[mode]) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()

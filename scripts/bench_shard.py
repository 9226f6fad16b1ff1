"""Benchmark of the sharded optimizer (ZeRO-1/2) against plain data parallelism: memory and step time, one run.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_shard.py            # np=2 and np=4, mpirun

Run without a launcher it is the driver: it starts the workers itself under mpirun (oversubscribed,
one thread per process) and prints, for each np,

1. per-rank optimizer-state bytes (the sum of the state tensors' bytes), measured, for plain DP,
   shard="optimizer" and shard="gradients", and their ratios to plain (expect 1/np), beside the
   plan's arithmetic (``dualframe.plan.memory``) for the same model;
2. per-rank gradient bytes alive at ``step()`` (``.grad`` of the parameters and of the slices);
3. peak resident memory per rank (``getrusage`` maxrss of a process that trains only that
   configuration, minus its resident size before the model was built), medians over the memory
   rounds, which take turns (A B C A B C ...); with ``MALLOC_MMAP_THRESHOLD_=131072`` unless
   ``--malloc default`` (glibc otherwise keeps freed large blocks, which the high-water mark counts);
4. step time of each sharded configuration / plain DP, interleaved in one process (median of
   per-round ratios; goal <= 1.10), for each gradient path of ``--scatter`` (default both:
   ``allreduce`` and ``reducescatter``, side by side, with their ratio per shard mode).

    .venv/bin/python scripts/bench_shard.py --np 2 --rounds 3                   # both scatter paths
    .venv/bin/python scripts/bench_shard.py --np 2 --memory-rounds 0 --scatter reducescatter

Model: an MLP of ``--depth`` Linear(width, width) layers (default 12 x 2048: 50.3 M parameters), Adam.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
import time
from typing import Any, Dict, List

import bench_env

bench_env.repo_on_path()


MODES = ("none", "optimizer", "gradients")
#: The sharded optimizer's gradient paths (``DistributedOptimizer(shard=..., scatter=...)``).
PATHS = ("allreduce", "reducescatter")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------- worker
def build(args: argparse.Namespace, mode: str, scatter: str = "auto") -> Any:
    import torch
    from torch import nn

    import dualframe.torch as hvd

    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4), model.named_parameters(),
                                         **({} if mode == "none" else {"shard": mode, "scatter": scatter}))
    x = torch.randn(args.batch_size, args.width)
    grads: Dict[str, int] = {}

    def step() -> None:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.synchronize()
        held = [p.grad for p in model.parameters()] + [p.grad for g in getattr(optimizer, "inner", optimizer)
                                                      .param_groups for p in g["params"] if mode != "none"]
        grads["bytes"] = sum(g.numel() * g.element_size() for g in held if g is not None)
        with optimizer.skip_synchronize():
            optimizer.step()
    return model, optimizer, step, grads


def state_bytes(optimizer: Any) -> int:
    import torch
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step")


def worker(args: argparse.Namespace) -> None:
    import torch

    import dualframe.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    result: Dict[str, Any] = {"np": hvd.size()}
    if args.worker == "memory":
        before = _rss_bytes()
        _, optimizer, step, grads = build(args, args.mode, args.scatter.split(",")[0])
        for _ in range(3):
            step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        result.update(mode=args.mode, state=state_bytes(optimizer), grads=grads["bytes"], peak=peak)
        every = hvd.allgather_object(result)
        result = max(every, key=lambda r: r["peak"])  # the rank with the highest peak
    else:
        # "none", then "<mode>/<path>" for each shard mode and gradient path, interleaved in one process.
        names = ["none"] + [f"{mode}/{path}" for mode in MODES[1:] for path in args.scatter.split(",")]
        contenders = {name: build(args, *name.split("/")) for name in names}
        for _, _, step, _ in contenders.values():
            step()  # warm-up: the first step allocates state and Horovod's buffers
        times: Dict[str, List[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for mode, (_, _, step, _) in contenders.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[mode].append((time.perf_counter() - start) / args.steps)
        result["times"] = times
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------- driver
def launch(np: int, args: argparse.Namespace, *extra: str) -> Dict[str, Any]:
    program = [sys.executable, str(pathlib.Path(__file__).resolve()), "--rounds", str(args.rounds), "--steps",
               str(args.steps), "--batch-size", str(args.batch_size), "--width", str(args.width), "--depth",
               str(args.depth), "--scatter", args.scatter, *extra]
    return bench_env.mpirun_result(np, program, mmap_threshold=args.malloc == "mmap")


def planned_state(args: argparse.Namespace, np: int, shard: str) -> float:
    """The plan's optimizer bytes per rank for this MLP with Adam (``dualframe.plan.memory``)."""
    from dualframe.plan.memory import OPTIMIZER_SLOTS, shard_divisors
    parameters = args.depth * (args.width * args.width + args.width)
    return parameters * 4 * OPTIMIZER_SLOTS["adam"] / shard_divisors(shard, np)[1]


def report(np: int, memory: Dict[str, List[Dict[str, Any]]], timing: Dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n== np={np} (mpirun, oversubscribed, one thread per process), {len(memory['none'])} memory rounds")
    if memory["none"]:
        report_memory(np, memory, args)
    times = timing["times"]
    for name in times:
        if name != "none":
            ratios = [s / p for s, p in zip(times[name], times["none"])]
            print(f"step time shard={name} / plain DP: median {statistics.median(ratios):.3f} "
                  f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})  (goal <= 1.10)")
    for mode in MODES[1:]:
        if f"{mode}/reducescatter" in times and f"{mode}/allreduce" in times:
            ratios = [r / a for r, a in zip(times[f"{mode}/reducescatter"], times[f"{mode}/allreduce"])]
            print(f"step time shard={mode}: reducescatter / allreduce median {statistics.median(ratios):.3f} "
                  f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})")
    print("step seconds (median): " + ", ".join(f"{m} {statistics.median(t):.3f}" for m, t in times.items()))


def report_memory(np: int, memory: Dict[str, List[Dict[str, Any]]], args: argparse.Namespace) -> None:
    mib = 2.0 ** 20
    median = {mode: {key: statistics.median(r[key] for r in runs) for key in ("state", "grads", "peak")}
              for mode, runs in memory.items()}
    print(f"memory: the gradient path of {args.scatter.split(',')[0]}")
    for mode in MODES:
        m, plain = median[mode], median["none"]
        plan = planned_state(args, np, None if mode == "none" else mode)  # type: ignore[arg-type]
        print(f"shard={mode:9s} state {m['state'] / mib:8.1f} MiB ({m['state'] / plain['state']:.3f} of plain; "
              f"plan {plan / mib:8.1f} MiB, measured/plan {m['state'] / plan:.4f})  "
              f"grads at step {m['grads'] / mib:7.1f} MiB ({m['grads'] / plain['grads']:.3f})  "
              f"peak RSS {m['peak'] / mib:7.1f} MiB ({m['peak'] / plain['peak']:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("memory", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="none", help=argparse.SUPPRESS)
    parser.add_argument("--np", default="2,4", help="process counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (each configuration takes turns)")
    parser.add_argument("--memory-rounds", type=int, default=2,
                        help="memory runs per configuration, interleaved (0: step time only)")
    parser.add_argument("--scatter", default=",".join(PATHS),
                        help="gradient paths of the sharded optimizer, comma-separated (allreduce, reducescatter, "
                             "auto): each is timed beside plain DP; memory uses the first")
    parser.add_argument("--steps", type=int, default=2, help="steps per configuration per timing round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--malloc", choices=("mmap", "default"), default="mmap",
                        help="mmap: MALLOC_MMAP_THRESHOLD_=131072 (large tensors returned to the system when "
                             "freed); default: glibc's dynamic threshold")
    args = parser.parse_args()
    unknown = [path for path in args.scatter.split(",") if path not in ("auto", *PATHS)]
    if unknown:
        parser.error(f"--scatter takes {', '.join(('auto', *PATHS))}, comma-separated (unknown: {', '.join(unknown)})")
    if args.worker:
        worker(args)
        return
    print(f"model: MLP {args.depth} x Linear({args.width}, {args.width}) "
          f"({args.depth * (args.width ** 2 + args.width) / 1e6:.1f} M parameters), Adam, batch {args.batch_size} "
          f"per rank; malloc {args.malloc}; load average at start {os.getloadavg()[0]:.1f}")
    for np in (int(n) for n in args.np.split(",")):
        memory: Dict[str, List[Dict[str, Any]]] = {mode: [] for mode in MODES}
        for _ in range(args.memory_rounds):
            for mode in MODES:
                memory[mode].append(launch(np, args, "--worker", "memory", "--mode", mode))
        report(np, memory, launch(np, args, "--worker", "time"), args)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""Benchmarks of PyTorch data parallelism: ratios measured in one run, A B A B interleaved rounds, median.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_torch_dp.py

Run without a launcher it is the driver: it starts the workers itself (np=1 plain, np=2 under
mpirun, np=2 under horovodrun --gloo) and prints

1. step time of dualframe.torch.DistributedOptimizer / horovod.torch.DistributedOptimizer (goal <= 1.02);
2. communication efficiency: throughput at np=2 with gradient averaging / throughput at np=2 with the
   plain optimizer, for Horovod's wrapper and dualframe's (none and fp16 compression), under each
   launcher (goal >= 0.95 under mpirun, better than Horovod under Gloo), with weak scaling np=2 vs np=1;
3. allreduce bus bandwidth through dualframe.torch.allreduce / raw horovod.torch.allreduce, 1-64 MB
   (goal >= 0.95).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

import bench_env
from bench_env import ROOT

bench_env.repo_on_path()
sys.path.insert(0, str(ROOT / "torch_examples"))

from dualframe.launch.commands import horovodrun_command, mpirun_command, thread_env  # noqa: E402
from dualframe.launch.topology import detect  # noqa: E402

MODEL = "mlp"  # 6.3M parameters, the model the Horovod figures were measured on


# ---------------------------------------------------------------------------------------- worker
def interleave(contenders: Dict[str, Callable[[], None]], rounds: int, steps: int) -> Dict[str, List[float]]:
    """Seconds per step of each contender, per round, the contenders taking turns within each round."""
    times: Dict[str, List[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, step in contenders.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def training_contenders(batch: int, plain: bool) -> Dict[str, Callable[[], None]]:
    import horovod.torch as horovod
    import torch
    import torch.nn.functional as F
    from synthetic_benchmark import build

    import dualframe.torch as hvd

    def contender(wrap: Callable) -> Callable[[], None]:
        torch.manual_seed(0)
        model = build(MODEL)
        optimizer = wrap(torch.optim.SGD(model.parameters(), lr=0.01), model)
        data, target = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

        def step() -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
        return step

    contenders = {
        "horovod": contender(lambda o, m: horovod.DistributedOptimizer(o, named_parameters=m.named_parameters())),
        "dualframe": contender(lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters())),
        "dualframe_fp16": contender(lambda o, m: hvd.DistributedOptimizer(
            o, named_parameters=m.named_parameters(), compression=hvd.Compression.fp16)),
    }
    if plain:
        contenders["plain"] = contender(lambda o, m: o)
    return contenders


def bandwidth(rounds: int) -> Dict[str, float]:
    import horovod.torch as horovod
    import torch

    import dualframe.torch as hvd

    n = hvd.size()
    ratios = {}
    for megabytes in (1, 4, 16, 64):
        tensor = torch.ones(megabytes * 2**20 // 4)
        repeats = max(2, 32 // megabytes)
        contenders = {
            "dualframe": lambda t=tensor, mb=megabytes: hvd.allreduce(t, name=f"bw.df.{mb}"),
            "horovod": lambda t=tensor, mb=megabytes: horovod.allreduce(t, name=f"bw.raw.{mb}"),
        }
        times = interleave(contenders, rounds, repeats)
        bus = {k: megabytes * 2 * (n - 1) / n / statistics.median(v) for k, v in times.items()}
        ratios[f"{megabytes}MB"] = statistics.median(
            [b / a for a, b in zip(times["dualframe"], times["horovod"])])
        ratios[f"{megabytes}MB_busbw_MBps"] = round(bus["dualframe"], 1)
    return ratios


def worker(args: argparse.Namespace) -> None:
    import torch

    import dualframe.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    contenders = training_contenders(args.batch_size, plain=True)
    interleave(contenders, 1, 2)  # warm-up: first steps allocate and fill Horovod's caches
    times = interleave(contenders, args.rounds, args.steps)
    result: Dict[str, object] = {"np": hvd.size(), "launcher": detect().launcher}
    median = {k: statistics.median(v) for k, v in times.items()}
    result["step_seconds"] = {k: round(v, 5) for k, v in median.items()}
    result["samples_per_second_per_rank"] = round(args.batch_size / median["dualframe"], 1)
    result["plain_samples_per_second_per_rank"] = round(args.batch_size / median["plain"], 1)
    result["dualframe_over_horovod"] = statistics.median(
        [a / b for a, b in zip(times["dualframe"], times["horovod"])])
    for name in ("horovod", "dualframe", "dualframe_fp16"):
        result[f"efficiency_{name}"] = statistics.median([p / a for a, p in zip(times[name], times["plain"])])
    if hvd.size() > 1:
        result["bandwidth_dualframe_over_horovod"] = bandwidth(args.rounds)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------- driver
def launch(launcher: str, np: int, args: argparse.Namespace) -> Dict:
    program = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
    bindir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), **thread_env(np, cores=np))
    if launcher == "horovodrun":
        command = horovodrun_command(np, program, horovodrun=str(bindir / "horovodrun"))
    elif launcher == "mpirun":
        command = mpirun_command(np, program, oversubscribe=True, export=("PATH", "PYTHONPATH", *thread_env(np)))
    else:
        command = program
    output = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900).stdout
    lines = [line.split("RESULT ", 1)[1] for line in output.splitlines() if "RESULT " in line]
    if not lines:
        raise SystemExit(f"{' '.join(command)} printed no result:\n{output[-3000:]}")
    return json.loads(lines[0])


def report(single: Dict, runs: Dict[str, Dict]) -> None:
    print(f"model {MODEL} (6.3M parameters), batch per rank as given; one thread per process")
    print(f"np=1 plain: {single['plain_samples_per_second_per_rank']} samples/s")
    for launcher, r in runs.items():
        print(f"\n== np=2 under {launcher}")
        print(f"1. step time dualframe / horovod DistributedOptimizer: {r['dualframe_over_horovod']:.3f}  (goal <= 1.02)")
        print(f"2. communication efficiency (with averaging / plain optimizer, np=2): "
              f"horovod {r['efficiency_horovod']:.3f}, dualframe {r['efficiency_dualframe']:.3f}, "
              f"dualframe fp16 {r['efficiency_dualframe_fp16']:.3f}")
        weak = r["samples_per_second_per_rank"] / single["plain_samples_per_second_per_rank"]
        print(f"   weak scaling np=2 vs np=1 (per-rank throughput with averaging / np=1 plain): {weak:.3f}")
        bw = r["bandwidth_dualframe_over_horovod"]
        sizes = [k for k in bw if not k.endswith("MBps")]
        print("3. allreduce bandwidth dualframe / raw horovod: " + ", ".join(f"{k} {bw[k]:.3f}" for k in sizes)
              + "  (goal >= 0.95); dualframe bus bandwidth MB/s: "
              + ", ".join(f"{k} {bw[k + '_busbw_MBps']}" for k in sizes))
        print(f"   step seconds (median): {r['step_seconds']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4, help="steps per contender per round")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--launchers", default="mpirun,horovodrun")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    single = launch("none", 1, args)
    runs = {launcher: launch(launcher, 2, args) for launcher in args.launchers.split(",")}
    report(single, runs)


if __name__ == "__main__":
    main()

"""Benchmark of torch ZeRO-3 (shard="parameters") against plain data parallelism, ZeRO-2 and torch FSDP2: memory and step time, one run.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_zero3_torch.py            # np=2, mpirun

Run without a launcher it is the driver: it starts the workers under mpirun (oversubscribed, one
thread per process) and prints, for each np,

1. per-rank bytes of parameters + gradients + Adam state held at ``step()`` (the storages of the
   model's parameters, their ``.grad``, the sharded optimizers' slices and their gradients, the state
   tensors), for plain DP, ZeRO-2 and ZeRO-3, their ratio to plain (expect 1, 0.5 + 0.5/np, 1/np)
   and the plan's figure (``dualframe.plan.memory``) beside it;
2. peak resident memory per rank (``getrusage`` maxrss of a process that trains only that
   configuration, minus its resident size before the model was built), medians over the memory
   rounds, which take turns; ``MALLOC_MMAP_THRESHOLD_=131072`` so freed blocks return to the system;
3. step time of ZeRO-2, ZeRO-3 and (``--fsdp``, default on) torch FSDP2 (``fully_shard`` per layer
   over a gloo process group) / plain DP, interleaved in one process (A B C D A B C D, median of
   per-round ratios); this launch leaves glibc's allocator as users have it (no mmap threshold);
4. (``--deepspeed-python``, default /work/ds-venv/bin/python; skipped when that python is missing)
   DeepSpeed ZeRO-3 on the same model, launched after each timing launch as np processes of its own
   venv (gloo, torch.optim.Adam), its step seconds against the timing launch's ZeRO-3 and plain DP.

ZeRO-3 runs with ``keep_gathered=--keep-gathered`` (default 1: the forward's last block stays gathered
until its backward). ``--autocast bfloat16`` runs every configuration's forward (DeepSpeed's too) under
``torch.autocast("cpu", torch.bfloat16)`` on the float32 weights (no loss scaling: bf16 needs none).

Model: an MLP of ``--depth`` Linear(width, width) layers (default 12 x 2048: 50.3 M parameters), Adam;
each Linear is a ZeRO-3 block (and an FSDP2 unit).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
from typing import Any, Callable, Dict, List, Tuple

import bench_env

bench_env.repo_on_path()


MODES = ("none", "gradients", "parameters", "fsdp2")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------- worker
def build(args: argparse.Namespace, mode: str) -> Tuple[Callable[[], None], Callable[[], int]]:
    """A step of ``mode`` and a count of the bytes it holds in parameters, gradients and optimizer state."""
    import torch
    from torch import nn

    import dualframe.torch as hvd

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    adam = torch.optim.Adam(model.parameters(), lr=1e-4)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        optimizer: Any = torch.optim.Adam(model.parameters(), lr=1e-4)
    elif mode == "none":
        optimizer = hvd.DistributedOptimizer(adam, model.named_parameters())
    else:
        optimizer = hvd.DistributedOptimizer(adam, model.named_parameters(), shard=mode,
                                             **({"model": model, "keep_gathered": args.keep_gathered}
                                                if mode == "parameters" else {}))
    x = torch.randn(args.batch_size, args.width)
    held: Dict[str, int] = {}

    def step() -> None:
        optimizer.zero_grad()
        with autocast(args):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        if mode == "fsdp2":  # its reduce-scatters finish inside backward
            held["bytes"] = holding(model, optimizer)
            optimizer.step()
            return
        optimizer.synchronize()  # every reduced slice present, as at step()
        held["bytes"] = holding(model, optimizer)
        with optimizer.skip_synchronize():
            optimizer.step()
    return step, lambda: held["bytes"]


def autocast(args: argparse.Namespace) -> Any:
    """The forward's autocast context (``--autocast``), disabled for float32."""
    import torch
    dtype = getattr(torch, args.autocast)
    return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)


def holding(model: Any, optimizer: Any) -> int:
    """Bytes of parameters, gradients and optimizer state alive now (each storage once)."""
    import torch
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    inner = getattr(optimizer, "inner", None)
    if inner is not None:
        tensors += [p for g in inner.param_groups for p in g["params"]] + [p.grad for g in inner.param_groups
                                                                             for p in g["params"]]
    state = inner.state if inner is not None else optimizer.state
    tensors += [v for s in state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    seen: Dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = getattr(t, "_local_tensor", t)  # an FSDP2 DTensor: this rank's shard
        storage = local.untyped_storage()
        if storage.nbytes():  # a ZeRO-3 parameter between uses holds none
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def start_torch_distributed() -> None:
    import torch.distributed as dist

    import dualframe.torch as hvd
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())


def worker(args: argparse.Namespace) -> None:
    import torch

    import dualframe.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    modes = [m for m in MODES if args.fsdp or m != "fsdp2"]
    if "fsdp2" in modes and (args.worker == "time" or args.mode == "fsdp2"):
        start_torch_distributed()
    result: Dict[str, Any] = {"np": hvd.size()}
    if args.worker == "memory":
        before = _rss_bytes()
        step, held = build(args, args.mode)
        for _ in range(3):
            step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        result.update(mode=args.mode, held=held(), peak=peak)
        result = max(hvd.allgather_object(result), key=lambda r: r["peak"])  # the rank with the highest peak
    else:
        contenders = {mode: build(args, mode)[0] for mode in modes}
        for step in contenders.values():
            step()  # warm-up: the first step allocates state and Horovod's buffers
        from bench_common import interleaved_steps
        times = interleaved_steps(contenders, (), args.steps, args.rounds, barrier=hvd.barrier)
        result["times"] = {mode: [t / args.steps for t in rounds] for mode, rounds in times.items()}
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def deepspeed_worker(args: argparse.Namespace) -> None:
    """DeepSpeed ZeRO-3 on the same MLP and batch (run by DeepSpeed's own python, torch.distributed's variables set)."""
    import time

    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    config = {"train_micro_batch_size_per_gpu": args.batch_size, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           optimizer=torch.optim.Adam(model.parameters(), lr=1e-4))
    x = torch.randn(args.batch_size, args.width)

    def step() -> None:
        with autocast(args):
            loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    step()  # warm-up, as the other configurations
    rounds = []
    for _ in range(args.rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        rounds.append((time.perf_counter() - start) / args.steps)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"deepspeed": rounds}), flush=True)


# ---------------------------------------------------------------------------------------- driver
def program(args: argparse.Namespace, python: str, *extra: str) -> List[str]:
    """This script's worker command line with the driver's model and timing arguments."""
    return [python, str(pathlib.Path(__file__).resolve()), "--rounds", str(args.rounds), "--steps",
            str(args.steps), "--batch-size", str(args.batch_size), "--width", str(args.width), "--depth",
            str(args.depth), "--keep-gathered", str(args.keep_gathered), "--fsdp" if args.fsdp else "--no-fsdp",
            "--autocast", args.autocast,
            *extra]


def launch(np: int, args: argparse.Namespace, *extra: str) -> Dict[str, Any]:
    # The timing launch keeps glibc's default allocator: MALLOC_MMAP_THRESHOLD_ (for the RSS figures) would
    # make each gathered block's buffer fresh zeroed pages, a cost a user's run does not pay.
    return bench_env.mpirun_result(np, program(args, sys.executable, *extra), mmap_threshold="memory" in extra)


def launch_deepspeed(np: int, args: argparse.Namespace) -> List[float]:
    """DeepSpeed ZeRO-3's seconds per step, per round: np processes of its venv's python (no launcher of ours)."""
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29733", WORLD_SIZE=str(np))
    env.pop("PYTHONPATH", None)
    command = program(args, args.deepspeed_python, "--worker", "deepspeed")
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(np)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(np)]
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    for line in "".join(outputs).splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["deepspeed"]  # type: ignore[no-any-return]
    print(f"DeepSpeed printed no result (exit {[p.returncode for p in procs]}):\n{''.join(outputs)[-3000:]}")
    return []


def planned(args: argparse.Namespace, np: int, mode: str) -> float:
    """The plan's parameter + gradient + Adam bytes per rank (``dualframe.plan.memory.sharded_bytes``)."""
    from dualframe.plan.memory import sharded_bytes
    parameters = args.depth * (args.width * args.width + args.width)
    return sum(sharded_bytes(parameters * 4, 2, None if mode == "none" else mode, np))


def planned_total(args: argparse.Namespace, np: int, mode: str) -> float:
    """The plan's whole per-rank memory for this MLP (``group_memory``: state, activations, buffers) under ``mode``."""
    from dualframe.plan import LayerProfile, ModelProfile, Training, group_memory
    width = args.width
    layers = [LayerProfile(f"l{j}", width * width + width, 0, width, width, width) for j in range(args.depth)]
    profile = ModelProfile("torch", "mlp", (width,), layers, input_elements=width)
    shard = None if mode == "none" else "parameters" if mode == "fsdp2" else mode
    return group_memory(profile, range(args.depth), Training(args.batch_size), replicas=np, shard=shard).total


def report(np: int, memory: Dict[str, List[Dict[str, Any]]], timing: Dict[str, Any], args: argparse.Namespace) -> None:
    mib = 2.0 ** 20
    print(f"\n== np={np} (mpirun, oversubscribed, one thread per process), {len(memory['none'])} memory rounds")
    if memory["none"]:
        median = {m: {k: statistics.median(r[k] for r in runs) for k in ("held", "peak")}
                  for m, runs in memory.items() if runs}
        for mode, m in median.items():
            plain = median["none"]
            plan = planned(args, np, "parameters" if mode == "fsdp2" else mode)  # FSDP2 against ZeRO-3's plan
            print(f"{mode:10s} parameters+gradients+Adam {m['held'] / mib:7.1f} MiB ({m['held'] / plain['held']:.3f} "
                  f"of plain; plan {plan / mib:7.1f} MiB, measured/plan {m['held'] / plan:.3f})  "
                  f"peak RSS {m['peak'] / mib:7.1f} MiB ({m['peak'] / plain['peak']:.3f}; "
                  f"/ the plan's total {m['peak'] / planned_total(args, np, mode):.3f})")
    times = timing["times"]
    for mode in times:
        if mode != "none":
            ratios = [s / p for s, p in zip(times[mode], times["none"])]
            print(f"step time {mode} / plain DP: median {statistics.median(ratios):.3f} "
                  f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})")
    if "fsdp2" in times:
        ratios = [s / f for s, f in zip(times["parameters"], times["fsdp2"])]
        print(f"step time ZeRO-3 / FSDP2: median {statistics.median(ratios):.3f}")
    if timing.get("deepspeed"):
        ours, theirs = statistics.median(times["parameters"]), statistics.median(timing["deepspeed"])
        print(f"step time ZeRO-3 / DeepSpeed ZeRO-3: {ours / theirs:.3f}; DeepSpeed ZeRO-3 / plain DP: "
              f"{theirs / statistics.median(times['none']):.3f} (DeepSpeed launched after, medians of the launches)")
    print("step seconds (median): " + ", ".join(f"{m} {statistics.median(t):.3f}" for m, t in times.items())
          + (f", deepspeed {statistics.median(timing['deepspeed']):.3f}" if timing.get("deepspeed") else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("memory", "time", "deepspeed"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="none", help=argparse.SUPPRESS)
    parser.add_argument("--np", default="2", help="process counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (each configuration takes turns)")
    parser.add_argument("--memory-rounds", type=int, default=2, help="memory runs per configuration (0: time only)")
    parser.add_argument("--steps", type=int, default=2, help="steps per configuration per timing round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True,
                        help="also torch FSDP2 (fully_shard per layer, gloo)")
    parser.add_argument("--keep-gathered", type=int, default=1,
                        help="ZeRO-3's keep_gathered: the forward's last blocks kept until their backward")
    parser.add_argument("--autocast", choices=("float32", "bfloat16"), default="float32",
                        help="the forward's compute dtype (torch.autocast on the float32 weights)")
    parser.add_argument("--deepspeed-python", default="/work/ds-venv/bin/python",
                        help="the python of a venv with DeepSpeed (skipped when missing)")
    args = parser.parse_args()
    if args.worker == "deepspeed":
        deepspeed_worker(args)
        return
    if args.worker:
        worker(args)
        return
    deepspeed = os.path.exists(args.deepspeed_python)
    if not deepspeed:
        print(f"DeepSpeed skipped: {args.deepspeed_python} is missing (--deepspeed-python)")
    print(f"model: MLP {args.depth} x Linear({args.width}, {args.width}) "
          f"({args.depth * (args.width ** 2 + args.width) / 1e6:.1f} M parameters), Adam, batch {args.batch_size} "
          f"per rank, forward in {args.autocast}; load average at start {os.getloadavg()[0]:.1f}")
    modes = [m for m in MODES if args.fsdp or m != "fsdp2"]
    for np in (int(n) for n in args.np.split(",")):
        memory: Dict[str, List[Dict[str, Any]]] = {mode: [] for mode in modes}
        for _ in range(args.memory_rounds):
            for mode in modes:
                memory[mode].append(launch(np, args, "--worker", "memory", "--mode", mode))
        timing = launch(np, args, "--worker", "time")
        if deepspeed:
            timing["deepspeed"] = launch_deepspeed(np, args)
        report(np, memory, timing, args)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

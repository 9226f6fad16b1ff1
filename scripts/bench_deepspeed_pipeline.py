"""dualframe's 2-process pipeline against DeepSpeed's PipelineEngine on the same model, quiet and under contention.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_deepspeed_pipeline.py \\
        --pairs 3 --contention

DeepSpeed lives in its own virtual environment (``python -m venv ds && ds/bin/pip install torch==2.13.0
deepspeed==0.19.8``: on a CPU it runs over gloo when oneCCL is missing), so the two cannot share a process:
this driver alternates launches (dualframe, DeepSpeed, dualframe, DeepSpeed, ...), each a fresh pair of
processes, one thread per process, timing ``--steps`` steps after ``--warmup``; a pair's ratio is DeepSpeed's
seconds per step over dualframe's (above 1: dualframe faster), and the medians are printed. Model: 12 x
(Linear(512, 512), ReLU), batch 2048, 2 stages, 8 micro-batches (dualframe ``chunks=8`` GPipe under
``mpirun``; DeepSpeed ``gradient_accumulation_steps=8``, its 1F1B-style ``TrainSchedule``), SGD.

``--busy K`` runs each pair with K competing CPU-bound processes (a Python busy loop each) started before
the pair and stopped after it; several values give a quiet and a loaded measurement in one run, and the
report prints each framework's step under load over its own quiet step (the goal: at most 1.10).
``--contention`` is ``--busy 0 <cores>``: quiet, then one competing process per core. Each setting prints
the load average, and dualframe's workers report the CPU seconds their threads other than the computing
one used per step (Horovod's background thread, MPI's, dualframe's heartbeat).

Where ``--deepspeed-python`` does not exist (a fresh machine has no DeepSpeed environment), the script
says so and measures dualframe alone.
"""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
WIDTH, BLOCKS, BATCH, CHUNKS = 512, 12, 2048, 8


def layers(nn):
    import torch
    torch.manual_seed(0)
    return [m for _ in range(BLOCKS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]


def dualframe_worker(steps: int, warmup: int) -> None:
    import torch
    from torch import nn

    import dualframe.torch as hvd
    from dualframe.torch.pipeline.distributed import DistributedPipeline

    hvd.init()
    torch.set_num_threads(1)
    model = nn.Sequential(*layers(nn))
    pipe = DistributedPipeline(model, [BLOCKS, BLOCKS], chunks=CHUNKS, loss_fn=nn.MSELoss())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-4)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step():
        optimizer.zero_grad()
        pipe.train_step(x, y)
        optimizer.step()
    report(hvd.rank(), step, hvd.barrier, steps, warmup)


def thread_seconds() -> dict:
    """CPU seconds of each of this process's threads so far, by thread id (Linux's /proc; empty elsewhere)."""
    seconds = {}
    tasks = pathlib.Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def deepspeed_worker(steps: int, warmup: int) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from torch import nn

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    net = PipelineModule(layers=layers(nn), num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // CHUNKS,
              "gradient_accumulation_steps": CHUNKS, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=net, config=config,
                                           optimizer=torch.optim.SGD(net.parameters(), lr=1e-4))
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    micro = [(x[k::CHUNKS].contiguous(), y[k::CHUNKS].contiguous()) for k in range(CHUNKS)]

    def step():
        engine.train_batch(data_iter=iter(micro))
    report(dist.get_rank(), step, dist.barrier, steps, warmup)


def report(rank, step, barrier, steps, warmup) -> None:
    """Time ``steps`` steps after ``warmup``; print seconds per step, and the other threads' CPU s per step of every rank."""
    for _ in range(warmup):
        step()
    barrier()
    before, start = thread_seconds(), time.perf_counter()
    for _ in range(steps):
        step()
    after = thread_seconds()
    barrier()
    wall = (time.perf_counter() - start) / steps
    main = str(threading.get_native_id())
    others = sum(after[t] - before.get(t, 0.0) for t in after if t != main) / steps
    print(f"OTHERS {rank} {others:.4f}", flush=True)
    if rank == 0:
        print("RESULT " + json.dumps({"seconds_per_step": wall}), flush=True)


def launch(which: str, args: argparse.Namespace):
    """One fresh pair of processes of ``which``: (seconds per step, the most CPU s per step a rank's other threads used)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    worker = [__file__, "--worker", which, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if which == "dualframe":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--bind-to", "none",
               "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", "-x", "PATH"]
        cmd += [flag for name in env if name.startswith(("HOROVOD_", "DUALFRAME_")) for flag in ("-x", name)]
        cmd += [sys.executable] + worker
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    else:
        base = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), WORLD_SIZE="2")
        procs = [subprocess.Popen([args.deepspeed_python] + worker, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=dict(base, RANK=str(r), LOCAL_RANK=str(r), LOCAL_SIZE="2"))
                 for r in range(2)]
    outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    text = "".join(outputs)  # the ranks' lines may interleave mid-line under mpirun: match, do not split
    others = max((float(v) for v in re.findall(r"OTHERS \d+ (\d+\.\d+)", text)), default=float("nan"))
    found = re.search(r"RESULT (\{[^}]*\})", text)
    if found:
        return json.loads(found.group(1))["seconds_per_step"], others
    raise SystemExit(f"{which} printed no result (exit {[p.returncode for p in procs]}):\n" + "".join(outputs)[-3000:])


def busy_processes(count: int):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("dualframe", "deepspeed"))
    parser.add_argument("--deepspeed-python", default="/work/ds-venv/bin/python", help="the python of DeepSpeed's venv")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--busy", type=int, nargs="+", default=[0], help="competing busy processes, per setting")
    parser.add_argument("--contention", action="store_true",
                        help="quiet, then one competing process per core (--busy 0 <cores>)")
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.contention:
        args.busy = [0, os.cpu_count() or 1]
    return args


def measure(args: argparse.Namespace, frameworks) -> dict:
    """(busy, framework) -> seconds per step of each pair; each setting's line printed as it ends."""
    seconds = {}
    for busy in args.busy:
        load, others = os.getloadavg()[0], {}
        for _ in range(args.pairs):
            hogs = busy_processes(busy)
            try:
                for which in frameworks:
                    step, other = launch(which, args)
                    seconds.setdefault((busy, which), []).append(step)
                    others.setdefault(which, []).append(other)
            finally:
                for hog in hogs:
                    hog.kill()
        times = ", ".join(f"{which} {statistics.median(seconds[(busy, which)]):.3f}" for which in frameworks)
        spare = ", ".join(f"{which} {statistics.median(others[which]):.3f}" for which in frameworks)
        line = f"busy {busy} (load average {load:.2f} before, {os.getloadavg()[0]:.2f} after): s per step: {times}"
        if len(frameworks) == 2:
            ratios = [t / o for o, t in zip(seconds[(busy, "dualframe")], seconds[(busy, "deepspeed")])]
            line += (f"; DeepSpeed / dualframe median {statistics.median(ratios):.2f} "
                     f"(pairs: {' '.join(f'{r:.2f}' for r in ratios)})")
        print(line + f"; other threads' CPU s per step: {spare}", flush=True)
    return seconds


def main() -> None:
    args = options()
    if args.worker:
        (dualframe_worker if args.worker == "dualframe" else deepspeed_worker)(args.steps, args.warmup)
        return
    frameworks = ("dualframe", "deepspeed")
    if not pathlib.Path(args.deepspeed_python).exists():
        print(f"DeepSpeed skipped: no python at {args.deepspeed_python} (DeepSpeed lives in a venv of its own, "
              "see the docstring; pass --deepspeed-python)", flush=True)
        frameworks = ("dualframe",)
    print(f"{BLOCKS} x (Linear({WIDTH}, {WIDTH}), ReLU), batch {BATCH}, 2 stages, {CHUNKS} micro-batches, "
          f"1 thread per process, {args.pairs} alternated pairs of {args.steps} steps, {os.cpu_count()} cores",
          flush=True)
    seconds = measure(args, frameworks)
    quiet = min(args.busy)
    for busy in args.busy:
        if busy != quiet:
            line = ", ".join(f"{which} {statistics.median(seconds[(busy, which)]) / statistics.median(seconds[(quiet, which)]):.2f}"
                             for which in frameworks)
            print(f"busy {busy} over busy {quiet}, step time: {line} (goal: at most 1.10)")


if __name__ == "__main__":
    main()

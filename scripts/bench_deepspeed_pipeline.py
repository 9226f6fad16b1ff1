"""dualframe's 2-process pipeline against DeepSpeed's PipelineEngine on the same model, quiet and under contention.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_deepspeed_pipeline.py \\
        --deepspeed-python /work/ds-venv/bin/python --pairs 3 --busy 0 2

DeepSpeed lives in its own virtual environment (``python -m venv ds && ds/bin/pip install torch==2.13.0
deepspeed==0.19.8``: on a CPU it runs over gloo when oneCCL is missing), so the two cannot share a process:
this driver alternates launches (dualframe, DeepSpeed, dualframe, DeepSpeed, ...), each a fresh pair of
processes, one thread per process, timing ``--steps`` steps after ``--warmup``; a pair's ratio is DeepSpeed's
seconds per step over dualframe's (above 1: dualframe faster), and the medians are printed. Model: 12 x
(Linear(512, 512), ReLU), batch 2048, 2 stages, 8 micro-batches (dualframe ``chunks=8`` GPipe under
``mpirun``; DeepSpeed ``gradient_accumulation_steps=8``, its 1F1B-style ``TrainSchedule``), SGD.

``--busy K`` runs each pair with K competing CPU-bound processes (a Python busy loop each) started before
the pair and stopped after it; several values give a quiet and a loaded measurement in one run, and the
report prints each framework's step under load over its own quiet step (the issue's goal: at most 1.10).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
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
    from dualframe.torch.distributed_pipeline import DistributedPipeline

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
    for _ in range(warmup):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    if rank == 0:
        print("RESULT " + json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}), flush=True)


def launch(which: str, args: argparse.Namespace) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    worker = [__file__, "--worker", which, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if which == "dualframe":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--bind-to", "none",
               "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", "-x", "PATH", sys.executable] + worker
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    else:
        base = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), WORLD_SIZE="2")
        procs = [subprocess.Popen([args.deepspeed_python] + worker, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=dict(base, RANK=str(r), LOCAL_RANK=str(r), LOCAL_SIZE="2"))
                 for r in range(2)]
    outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    for line in "".join(outputs).splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["seconds_per_step"]
    raise SystemExit(f"{which} printed no result (exit {[p.returncode for p in procs]}):\n" + "".join(outputs)[-3000:])


def busy_processes(count: int):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("dualframe", "deepspeed"))
    parser.add_argument("--deepspeed-python", default="ds/bin/python", help="the python of DeepSpeed's venv")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--busy", type=int, nargs="+", default=[0], help="competing busy processes, per setting")
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.worker:
        (dualframe_worker if args.worker == "dualframe" else deepspeed_worker)(args.steps, args.warmup)
        return
    print(f"{BLOCKS} x (Linear({WIDTH}, {WIDTH}), ReLU), batch {BATCH}, 2 stages, {CHUNKS} micro-batches, "
          f"1 thread per process, {args.pairs} alternated pairs of {args.steps} steps", flush=True)
    seconds = {}
    for busy in args.busy:
        for _ in range(args.pairs):
            hogs = busy_processes(busy)
            try:
                for which in ("dualframe", "deepspeed"):
                    seconds.setdefault((busy, which), []).append(launch(which, args))
            finally:
                for hog in hogs:
                    hog.kill()
        ours, theirs = seconds[(busy, "dualframe")], seconds[(busy, "deepspeed")]
        ratios = [t / o for o, t in zip(ours, theirs)]
        print(f"busy {busy}: DeepSpeed / dualframe step: median {statistics.median(ratios):.2f} "
              f"(pairs: {' '.join(f'{r:.2f}' for r in ratios)}); seconds per step: dualframe "
              f"{statistics.median(ours):.3f}, DeepSpeed {statistics.median(theirs):.3f}", flush=True)
    quiet = min(args.busy)
    for busy in args.busy:
        if busy != quiet:
            line = ", ".join(f"{which} {statistics.median(seconds[(busy, which)]) / statistics.median(seconds[(quiet, which)]):.2f}"
                             for which in ("dualframe", "deepspeed"))
            print(f"busy {busy} over busy {quiet}, step time: {line}")


if __name__ == "__main__":
    main()

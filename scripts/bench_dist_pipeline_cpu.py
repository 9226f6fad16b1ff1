"""Where a process pipeline's CPU goes under a launcher: CPU seconds per step of each thread and of the launcher.

    OMP_NUM_THREADS=1 .venv/bin/horovodrun -np 2 -H localhost:2 --gloo \\
        .venv/bin/python scripts/bench_dist_pipeline_cpu.py --chunks 8
    mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none -x OMP_NUM_THREADS=1 -x PATH -x PYTHONPATH \\
        .venv/bin/python scripts/bench_dist_pipeline_cpu.py --chunks 8

The torch model of bench_dist_pipeline.py (12 x (Linear(512, 512), ReLU), batch 2048, 2 stages, one
thread per process). After two warm-up steps, each rank prints the wall seconds per step, the busy
seconds of its stage per step, and the CPU seconds per step of: its main thread (the stage's work and
the transport's waits), ZeroMQ's I/O thread, its other threads (Horovod's background thread, which
cycles every HOROVOD_CYCLE_TIME ms, above all) and the processes above it up to the shell (the
launcher: horovodrun's driver and its shell, or mpirun's orted). CPU seconds, unlike wall seconds,
barely move with the load of a shared box, so they tell a launcher's own cost from other jobs'.
"""
import collections
import os
import time

import psutil
import torch
from torch import nn

import bench_common
import dualframe.torch as hvd
from bench_torch import linear_relu
from dualframe.torch.pipeline.distributed import DistributedPipeline


def thread_seconds() -> collections.Counter:
    """CPU seconds so far of this process's threads, by kind: main, ZeroMQ I/O, other."""
    seconds: collections.Counter = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        kind = "main" if int(tid) == os.getpid() else "zmq I/O" if name.startswith("ZMQ") else "other threads"
        seconds[kind] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return seconds


def launcher_seconds() -> float:
    """CPU seconds so far of the processes above this one, up to the shell that started the launcher."""
    total, proc = 0.0, psutil.Process().parent()
    while proc is not None and proc.name() not in ("bash", "zsh", "timeout", "flock", "pytest", "systemd", "init"):
        times = proc.cpu_times()
        total += times.user + times.system
        proc = proc.parent()
    return total


def main() -> None:
    parser = bench_common.parser(__doc__, chunks=8, steps=6)
    parser.add_argument("--transport", default="auto", choices=("auto", "mpi", "zmq", "horovod"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    pipe = DistributedPipeline(linear_relu(512, 12), [12, 12], chunks=args.chunks, loss_fn=nn.MSELoss(),
                               transport=args.transport)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-4)
    x, y = torch.randn(2048, 512), torch.randn(2048, 512)

    def step() -> None:
        optimizer.zero_grad()
        pipe.train_step(x, y)
        optimizer.step()
    step(), step()
    hvd.barrier()
    threads, launcher, start = thread_seconds(), launcher_seconds(), time.perf_counter()
    for _ in range(args.steps):
        step()
    hvd.barrier()
    wall = (time.perf_counter() - start) / args.steps
    used = {kind: (seconds - threads[kind]) / args.steps for kind, seconds in thread_seconds().items()}
    used["launcher"] = (launcher_seconds() - launcher) / args.steps
    line = ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in used.items())
    lines = hvd.allgather_object(f"rank {hvd.rank()}: wall {wall:.3f} s/step, busy {pipe.records.mean_busy():.3f} "
                                 f"s/step; CPU s/step: {line}")
    if hvd.rank() == 0:
        print(f"chunks={args.chunks}, messages over {pipe.transport}, HOROVOD_CYCLE_TIME="
              f"{os.environ.get('HOROVOD_CYCLE_TIME', 'unset')}, load {os.getloadavg()[0]:.1f}\n" + "\n".join(lines),
              flush=True)


if __name__ == "__main__":
    main()

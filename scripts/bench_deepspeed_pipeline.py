"""dualframe's 2-process pipeline against DeepSpeed's PipelineEngine on the same model, quiet and under contention.

    flock /tmp/dualframe-mp.lock .venv/bin/python scripts/bench_deepspeed_pipeline.py --rounds 4 --contention

DeepSpeed lives in its own virtual environment (``python -m venv ds && ds/bin/pip install torch==2.13.0
deepspeed==0.19.8``: on a CPU it runs over gloo when oneCCL is missing), so the two cannot share a process.
Model: 12 x (Linear(512, 512), ReLU), batch 2048, 2 stages, 8 micro-batches (dualframe ``chunks=8`` GPipe
under ``mpirun``; DeepSpeed ``gradient_accumulation_steps=8``, its 1F1B-style ``TrainSchedule``), SGD, one
thread per process.

A round launches each framework once (a fresh pair of processes), the order alternating from round to
round (dualframe first, then DeepSpeed first). Inside one launch each load setting is timed in turn,
``--steps`` steps after ``--warmup``, the settings' order also alternating: ``--busy K`` has rank 0 start K
competing CPU-bound processes (a Python busy loop each) before the setting's steps and stop them after.
``--contention`` is ``--busy 0 <cores>``: quiet, and one competing process per core. The busy processes
run in a session of their own, as another job's would (``--hogs own``; Linux's autogroup then shares
the cores between sessions first), or in the job's session (``--hogs job``: they compete thread by
thread with the ranks). A setting's ratio is dualframe's step over DeepSpeed's in the same round (below
1: dualframe faster); the figure of merit is each round's loaded ratio over its quiet ratio, whose median
over the rounds the script prints against the goal (at most 1.10: contention hurts dualframe no more
than DeepSpeed, + 10 %). Both launches of a round and both settings of a launch run seconds apart, so a
load that others put on the machine meanwhile mostly cancels; the load average is printed per round.
Each rank also reports, per step, the CPU seconds of its threads other than the computing one by name
(dualframe's labelled ``mpi``, ``horovod`` (Horovod's background thread), Python's by their name; DeepSpeed's
``gloo_tcp_loop``), and the seconds its computing thread was ready to run but waited for a core.

Where ``--deepspeed-python`` does not exist (a fresh machine has no DeepSpeed environment), the script
says so and measures dualframe alone. ``HOROVOD_*`` and ``DUALFRAME_*`` variables reach dualframe's ranks.
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
GOAL = 1.10


def layers(nn):
    import torch
    torch.manual_seed(0)
    return [m for _ in range(BLOCKS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]


def label_threads(name: str) -> None:
    """Name this process's threads still called like the process ``name`` (``/proc``'s comm), Python's by their own name."""
    python = {str(t.native_id): t.name for t in threading.enumerate() if t.native_id != threading.get_native_id()}
    tasks = pathlib.Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            if task.name != str(threading.get_native_id()) and (task / "comm").read_text().strip() == "python":
                (task / "comm").write_text(python.get(task.name, name)[:15])
        except OSError:  # the thread ended meanwhile, or /proc is read-only
            pass


def dualframe_worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import dualframe.torch as hvd
    from dualframe.launch.mpi_world import start_mpi
    from dualframe.torch.pipeline.distributed import DistributedPipeline

    label_threads("torch")
    start_mpi()
    label_threads("mpi")
    hvd.init()
    label_threads("horovod")
    torch.set_num_threads(1)
    model = nn.Sequential(*layers(nn))
    pipe = DistributedPipeline(model, [BLOCKS, BLOCKS], chunks=CHUNKS, loss_fn=nn.MSELoss())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-4)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    label_threads("pipeline")

    def step():
        optimizer.zero_grad()
        pipe.train_step(x, y)
        optimizer.step()
    report(hvd.rank(), step, hvd.barrier, args)


def deepspeed_worker(args: argparse.Namespace) -> None:
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
    report(dist.get_rank(), step, dist.barrier, args)


def thread_seconds() -> dict:
    """CPU seconds of each of this process's threads so far, by (thread id, name) (Linux's /proc; empty elsewhere)."""
    seconds = {}
    tasks = pathlib.Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            name, fields = (task / "stat").read_text().split("(", 1)[1].rsplit(")", 1)
        except OSError:  # the thread ended meanwhile
            continue
        fields = fields.split()
        seconds[(task.name, name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def queued_seconds() -> float:
    """Seconds this thread has been ready to run but waiting for a core (Linux's schedstat; 0 elsewhere)."""
    try:
        return int(pathlib.Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError):
        return 0.0


def timed(rank, step, barrier, steps: int, busy: int, own_session: bool) -> dict:
    """Seconds per step of ``steps`` steps with ``busy`` competing processes (rank 0's), and the other threads' CPU s per step."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=own_session)
            for _ in range(busy if rank == 0 else 0)]
    try:
        barrier()
        before, queued, start = thread_seconds(), queued_seconds(), time.perf_counter()
        for _ in range(steps):
            step()
        after, wall = thread_seconds(), (time.perf_counter() - start) / steps
        queued = (queued_seconds() - queued) / steps
        barrier()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    main, others, compute = str(threading.get_native_id()), {}, 0.0
    for (tid, name), seconds in after.items():
        spent = (seconds - before.get((tid, name), 0.0)) / steps
        if tid == main:
            compute = spent
        else:
            others[name] = others.get(name, 0.0) + spent
    return {"seconds": wall, "compute": round(compute, 4), "queued": round(queued, 4), "others": {n: round(s, 4) for n, s in others.items() if s > 0}}


def report(rank, step, barrier, args: argparse.Namespace) -> None:
    """Time every load setting in ``args.busy`` (in that order) and print this rank's RESULT line."""
    for _ in range(args.warmup):
        step()
    results = {str(busy): timed(rank, step, barrier, args.steps, busy, args.hogs == "own") for busy in args.busy}
    print(f"RESULT {rank} " + json.dumps(results), flush=True)


def launch(which: str, order, args: argparse.Namespace) -> dict:
    """One fresh pair of processes of ``which`` timing each setting of ``order``: {busy: {seconds, others: [rank 0's, rank 1's]}}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    worker = [__file__, "--worker", which, "--steps", str(args.steps), "--warmup", str(args.warmup), "--hogs", args.hogs,
              "--busy", *map(str, order)]
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
    text = "".join(p.communicate(timeout=args.timeout)[0] for p in procs)
    # the ranks' lines may interleave mid-line under mpirun: match, do not split
    ranks = {int(found.group(1)): json.JSONDecoder().raw_decode(text, found.end())[0]
             for found in re.finditer(r"RESULT (\d) ", text)}
    if set(ranks) != {0, 1}:
        raise SystemExit(f"{which} printed no result (exit {[p.returncode for p in procs]}):\n" + text[-3000:])
    return {int(busy): {"seconds": ranks[0][busy]["seconds"], "others": [ranks[r][busy]["others"] for r in (0, 1)],
                        "compute": [ranks[r][busy]["compute"] for r in (0, 1)],
                        "queued": [ranks[r][busy]["queued"] for r in (0, 1)]}
            for busy in ranks[0]}


def busy_order(args: argparse.Namespace, k: int):
    """The load settings of round ``k``: as given in even rounds, reversed in odd ones."""
    return list(args.busy) if k % 2 == 0 else list(reversed(args.busy))


def round_line(k: int, load: float, results: dict, frameworks) -> str:
    """One round's seconds per step, ratios and other threads' CPU, as printed."""
    parts = [f"round {k} (load average {load:.2f} before, {os.getloadavg()[0]:.2f} after):"]
    for busy in sorted(results[frameworks[0]]):
        times = " ".join(f"{which} {results[which][busy]['seconds']:.3f}" for which in frameworks)
        ratio = (f", dualframe / DeepSpeed {results['dualframe'][busy]['seconds'] / results['deepspeed'][busy]['seconds']:.2f}"
                 if len(frameworks) == 2 else "")
        parts.append(f"busy {busy}: s per step {times}{ratio};")
    return " ".join(parts)


def thread_line(frameworks, others: dict) -> str:
    """The median CPU s per step of each rank's threads (and its computing thread's wait for a core), per framework and setting."""
    lines = []
    for (which, busy), per_round in sorted(others.items()):
        for rank in (0, 1):
            names = ["computing", "queued"] + sorted({n for ranks in per_round for n in ranks[rank]} - {"computing", "queued"})
            spent = ", ".join(f"{name} {statistics.median(r[rank].get(name, 0.0) for r in per_round):.4f}" for name in names)
            lines.append(f"  {which} busy {busy} rank {rank}: {spent or 'none'}")
    return ("CPU s per step of the computing thread (computing), its wait for a core (queued) and the other "
            "threads, by name (median over rounds):\n" + "\n".join(lines))


def verdict(args: argparse.Namespace, seconds: dict, frameworks) -> None:
    """Each framework's loaded step over its quiet one, and (with both) the ratio under load over the quiet ratio."""
    quiet = min(args.busy)
    for busy in (b for b in args.busy if b != quiet):
        slow = {which: [s[busy] / s[quiet] for s in seconds[which]] for which in frameworks}
        line = ", ".join(f"{which} {statistics.median(v):.2f}" for which, v in slow.items())
        print(f"busy {busy}: step over the quiet step (median over rounds): {line}")
        if len(frameworks) == 2:
            worse = [d / s for d, s in zip(slow["dualframe"], slow["deepspeed"])]
            met = "met" if statistics.median(worse) <= GOAL else "NOT met"
            print(f"busy {busy}: (dualframe / DeepSpeed under load) / (dualframe / DeepSpeed quiet): median "
                  f"{statistics.median(worse):.2f} (rounds: {' '.join(f'{w:.2f}' for w in worse)}); "
                  f"goal at most {GOAL:.2f}: {met}")


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("dualframe", "deepspeed"))
    parser.add_argument("--deepspeed-python", default="/work/ds-venv/bin/python", help="the python of DeepSpeed's venv")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--busy", type=int, nargs="+", default=[0], help="competing busy processes, per setting")
    parser.add_argument("--contention", action="store_true",
                        help="quiet, then one competing process per core (--busy 0 <cores>)")
    parser.add_argument("--hogs", choices=("own", "job"), default="own",
                        help="the busy processes in a session of their own (another job's) or in the job's")
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.contention:
        args.busy = [0, os.cpu_count() or 1]
    return args


def main() -> None:
    args = options()
    if args.worker:
        (dualframe_worker if args.worker == "dualframe" else deepspeed_worker)(args)
        return
    frameworks = ("dualframe", "deepspeed")
    if not pathlib.Path(args.deepspeed_python).exists():
        print(f"DeepSpeed skipped: no python at {args.deepspeed_python} (DeepSpeed lives in a venv of its own, "
              "see the docstring; pass --deepspeed-python)", flush=True)
        frameworks = ("dualframe",)
    print(f"{BLOCKS} x (Linear({WIDTH}, {WIDTH}), ReLU), batch {BATCH}, 2 stages, {CHUNKS} micro-batches, "
          f"1 thread per process, {args.rounds} rounds of {args.steps} steps per setting, {os.cpu_count()} cores",
          flush=True)
    seconds, others = {which: [] for which in frameworks}, {}
    for k in range(args.rounds):
        load, results = os.getloadavg()[0], {}
        for which in (frameworks if k % 2 == 0 else tuple(reversed(frameworks))):
            results[which] = launch(which, busy_order(args, k), args)
            seconds[which].append({busy: r["seconds"] for busy, r in results[which].items()})
            for busy, r in results[which].items():
                others.setdefault((which, busy), []).append(
                    [dict(o, computing=c, queued=q) for o, c, q in zip(r["others"], r["compute"], r["queued"])])
        print(round_line(k, load, results, frameworks), flush=True)
    print(thread_line(frameworks, others))
    verdict(args, seconds, frameworks)


if __name__ == "__main__":
    main()

"""Benchmark the Keras sharded optimizer (ZeRO-1/2) against plain data parallelism: memory and step time, as ratios.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_shard_tf.py               # np=2 and np=4
    .venv/bin/python scripts/bench_shard_tf.py --ranks 2 --rounds 5 --width 2048 --layers 5
    .venv/bin/python scripts/bench_shard_tf.py --ranks 2 --launcher gloo --time-only --scatter reducescatter allreduce

For each number of ranks (np=4 is oversubscribed on a small box: one thread per process), under mpirun
(or ``horovodrun --gloo`` with ``--launcher gloo``):

memory: one launch per mode (plain DistributedOptimizer, shard="optimizer", shard="gradients") of an
        MLP of ``layers`` Dense(width x width) layers (5 x 2048^2: 21M parameters) with Adam. Each rank
        reports its optimizer-state bytes (the slot variables it holds: Adam's m and v) and its peak
        resident memory (``ru_maxrss``); printed as sharded / plain (goal for the state: 1/np).
time:   one launch holding all the models (one per sharded mode and ``--scatter`` path); rounds interleave
        them (order rotated each round) and each times ``steps`` fit steps; the median of the per-round
        ratios sharded / plain (goal <= 1.10).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import bench_env

bench_env.repo_on_path()

from dualframe.launch.commands import horovodrun_command, mpirun_command, thread_env  # noqa: E402

MODES = ("plain", "optimizer", "gradients")
BUCKET_ELEMENTS = [None]  # set from --bucket-elements in the worker


def _model_and_data(width: int, layers: int, batch: int, steps: int, mode: str, scatter: str = "auto") -> tuple:
    import numpy as np
    import keras
    import dualframe.tensorflow.keras as hvd

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="relu")
                                                        for _ in range(layers - 1)] + [keras.layers.Dense(10)])
    shard = None if mode == "plain" else mode
    extra = {} if shard is None else {"scatter": scatter}
    if shard is not None and BUCKET_ELEMENTS[0]:
        extra["bucket_elements"] = BUCKET_ELEMENTS[0]
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-4), shard=shard, **extra),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(hvd.rank())
    x, y = rng.randn(steps * batch, width).astype("float32"), rng.randint(0, 10, steps * batch)
    model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, verbose=0,  # build and trace outside the timing
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return model, x, y


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer slot variables this rank holds (the sharded optimizer knows its own)."""
    import numpy as np

    if hasattr(optimizer, "state_bytes"):
        return int(optimizer.state_bytes())
    return sum(int(np.prod(v.shape)) * 4 for v in optimizer.inner_optimizer.variables if len(v.shape))


def contenders(scatters: list) -> list:
    """The timed models: plain, then each sharded mode with each scatter path ("optimizer/allreduce" ...)."""
    return ["plain"] + [m if len(scatters) == 1 else f"{m}/{s}" for m in MODES[1:] for s in scatters]


def worker(part: str, mode: str, width: int, layers: int, batch: int, steps: int, rounds: int,
           scatters: list) -> None:
    """Under a launcher: rank 0 prints one RESULT line of JSON."""
    import tensorflow as tf
    import dualframe.tensorflow.keras as hvd

    hvd.init()
    if part == "memory":
        model, x, y = _model_and_data(width, layers, batch, steps, mode)
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        values = hvd.allgather(tf.constant([[state_bytes(model.optimizer), peak]], dtype=tf.int64)).numpy()
        result = {"state_bytes": int(values[:, 0].max()), "peak_rss": int(values[:, 1].max()),
                  "parameters": int(model.count_params())}
    else:
        names = contenders(scatters)
        models = {n: _model_and_data(width, layers, batch, steps, n.split("/")[0],
                                     n.split("/")[1] if "/" in n else scatters[0]) for n in names}
        times: dict = {n: [] for n in names}
        for k in range(rounds):
            order = names[k % len(names):] + names[:k % len(names)]  # the first in a round pays for waking up
            for m in order:
                model, x, y = models[m]
                hvd.barrier()
                start = time.perf_counter()
                model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
                elapsed = float(hvd.allreduce(tf.constant((time.perf_counter() - start) / steps), op=hvd.Max))
                times[m].append(elapsed)
        result = times
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def launch(ranks: int, part: str, mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **thread_env(ranks, cores=ranks))
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env['PATH']}"
    program = [sys.executable, __file__, "--worker", part, "--mode", mode, "--width", str(args.width),
               "--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
               "--rounds", str(args.rounds), "--scatter", *args.scatter,
               *(["--bucket-elements", str(args.bucket_elements)] if args.bucket_elements else [])]
    if args.launcher == "gloo":
        command = horovodrun_command(ranks, program, hosts=f"localhost:{ranks}")
    else:
        command = mpirun_command(ranks, program, oversubscribe=True,
                                 export=("PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", *thread_env(1)))
    output = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
    line = next(line for line in output.splitlines() if "RESULT " in line)  # horovodrun prefixes "[0]<stdout>:"
    return json.loads(line.split("RESULT ", 1)[1])


def report(ranks: int, args: argparse.Namespace) -> None:
    if not args.time_only:
        report_memory(ranks, args)
    times = launch(ranks, "time", "all", args)
    base = statistics.median(times["plain"])
    for name in contenders(args.scatter)[1:]:
        ratios = [t / p for t, p in zip(times[name], times["plain"])]
        print(f"  np={ranks} {args.launcher} step time shard={name!r}: {statistics.median(times[name]) * 1e3:.1f} ms "
              f"vs plain {base * 1e3:.1f} ms, ratio {statistics.median(ratios):.3f} (median of {args.rounds} "
              f"interleaved rounds: {' '.join(f'{r:.2f}' for r in ratios)}; goal <= 1.10)", flush=True)


def report_memory(ranks: int, args: argparse.Namespace) -> None:
    memory = {m: launch(ranks, "memory", m, args) for m in MODES}
    plain = memory["plain"]
    print(f"np={ranks}: {plain['parameters'] / 1e6:.1f}M parameters, Adam; per rank (max over ranks):")
    for m in MODES:
        row = memory[m]
        print(f"  {m:9s} optimizer state {row['state_bytes'] / 2**20:7.1f} MiB "
              f"({row['state_bytes'] / plain['state_bytes']:.3f} of plain; goal {1 / ranks:.3f}), "
              f"peak RSS {row['peak_rss'] / 2**20:7.1f} MiB ({row['peak_rss'] / plain['peak_rss']:.3f} of plain, "
              f"{(row['peak_rss'] - plain['peak_rss']) / 2**20:+.1f} MiB)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--launcher", choices=["mpirun", "gloo"], default="mpirun")
    parser.add_argument("--scatter", nargs="+", default=["auto"], choices=["auto", "reducescatter", "allreduce"],
                        help="the sharded optimizer's reduce-scatter path(s) to time (each a contender)")
    parser.add_argument("--bucket-elements", type=int, default=None, help="the sharded optimizer's bucket cap (default: its own, 4M elements)")
    parser.add_argument("--time-only", action="store_true", help="skip the memory launches")
    parser.add_argument("--worker", choices=["memory", "time"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    BUCKET_ELEMENTS[0] = args.bucket_elements
    if args.worker:
        worker(args.worker, args.mode, args.width, args.layers, args.batch, args.steps, args.rounds, args.scatter)
        return
    print(f"load average {os.getloadavg()[0]:.2f} at start", flush=True)
    for ranks in args.ranks:
        report(ranks, args)
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()

"""Benchmark Keras 3 data parallelism; prints ratios from interleaved A/B rounds (median).

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_tf_dp.py            # both parts
    .venv/bin/python scripts/bench_tf_dp.py overhead --rounds 7
    .venv/bin/python scripts/bench_tf_dp.py scaling --rounds 3

overhead: one process, ``fit`` with ``hvd.DistributedOptimizer`` vs plain ``fit``; ratio of step
          times (goal <= 1.05).
scaling:  weak scaling, np=2 vs np=1 under mpirun, one thread per process, a compute-bound CNN with
          a fixed batch per rank: efficiency = images/sec per rank at np=2 / at np=1 (goal >= 0.90).
          A third arm in the same rounds runs np=2 with the plain optimizer (no allreduce at all):
          its efficiency is the machine's own ceiling for two processes, and DP / plain at np=2 is
          what data parallelism costs on top of it.
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

import bench_env

bench_env.repo_on_path()

from dualframe.launch.commands import mpirun_command, thread_env  # noqa: E402


def overhead(rounds: int, steps: int) -> None:
    import numpy as np
    import keras
    import dualframe.tensorflow.keras as hvd

    hvd.init()
    rng = np.random.RandomState(0)
    x, y = rng.randn(steps * 64, 256).astype("float32"), rng.randint(0, 10, steps * 64)

    def compiled(distributed: bool) -> keras.Model:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer) if distributed else optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x[:128], y[:128], batch_size=64, verbose=0)  # trace outside the timing
        return model

    plain, wrapped = compiled(False), compiled(True)
    ratios = []
    for k in range(rounds):
        times = {}
        # A B, then B A: whichever runs first in a round pays for waking the machine up.
        for name, model in (("plain", plain), ("wrapped", wrapped))[::1 if k % 2 == 0 else -1]:
            start = time.perf_counter()
            model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
            times[name] = (time.perf_counter() - start) / steps
        times = [times["plain"], times["wrapped"]]
        ratios.append(times[1] / times[0])
        print(f"  plain {times[0] * 1e3:.2f} ms/step, DistributedOptimizer {times[1] * 1e3:.2f} ms/step, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"overhead at np=1: step time DistributedOptimizer / plain fit = {statistics.median(ratios):.3f} "
          f"(median of {rounds} rounds; goal <= 1.05)")


def worker(steps: int, batch: int, plain: bool) -> None:
    """Run under a launcher: time ``steps`` fit steps of a small CNN; rank 0 prints img/sec per rank as JSON.

    ``plain``: every rank trains on its own with the unwrapped optimizer (no collective while timed).
    """
    import numpy as np
    import keras
    import tensorflow as tf
    import dualframe.tensorflow.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([
        keras.Input((48, 48, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.01)
    model.compile(optimizer=optimizer if plain else hvd.DistributedOptimizer(optimizer),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.RandomState(hvd.rank()).rand(steps * batch, 48, 48, 3).astype("float32")
    y = np.random.RandomState(hvd.rank()).randint(0, 10, steps * batch)
    model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, verbose=0,
              callbacks=[] if plain else [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    hvd.barrier()
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    rate = float(hvd.allreduce(tf.constant(steps * batch / (time.perf_counter() - start)), op=hvd.Average))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"np": hvd.size(), "img_per_sec_per_rank": rate}), flush=True)


def run_worker(np_: int, steps: int, batch: int, plain: bool = False) -> float:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **thread_env(np_, cores=np_))
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env['PATH']}"
    program = [sys.executable, __file__, "worker", "--steps", str(steps), "--batch", str(batch)]
    command = mpirun_command(np_, program + (["--plain"] if plain else []),
                             oversubscribe=True, export=("PATH", "TF_CPP_MIN_LOG_LEVEL", *thread_env(1)))
    output = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    return float(json.loads(line[len("RESULT "):])["img_per_sec_per_rank"])


def scaling(rounds: int, steps: int, batch: int) -> None:
    efficiencies, ceilings, shares = [], [], []
    for _ in range(rounds):  # interleaved: 1, 2, 2-plain, 1, 2, 2-plain ...
        one, two, alone = run_worker(1, steps, batch), run_worker(2, steps, batch), run_worker(2, steps, batch, True)
        efficiencies.append(two / one)
        ceilings.append(alone / one)
        shares.append(two / alone)
        print(f"  np=1 {one:.1f} img/s, np=2 {two:.1f} img/s per rank ({2 * two:.1f} total), "
              f"efficiency {efficiencies[-1]:.3f}; np=2 without allreduce {alone:.1f} img/s per rank "
              f"(ceiling {ceilings[-1]:.3f}), DP / no-allreduce {shares[-1]:.3f}", flush=True)
    print(f"weak scaling np=2 vs np=1 (one thread per process, batch {batch} per rank): efficiency = "
          f"{statistics.median(efficiencies):.3f} (median of {rounds} rounds; goal >= 0.90)")
    print(f"  the machine's ceiling (np=2 plain optimizer, no communication, vs np=1) = "
          f"{statistics.median(ceilings):.3f}; data parallel / that ceiling = {statistics.median(shares):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", default="all", choices=["all", "overhead", "scaling", "worker"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--plain", action="store_true", help="worker: the unwrapped optimizer, no collective")
    args = parser.parse_args()
    if args.part == "worker":
        worker(args.steps, args.batch, args.plain)
        return
    if args.part in ("all", "overhead"):
        os.environ.update(thread_env(1, cores=1))  # one thread, as each rank would have
        overhead(args.rounds, steps=max(args.steps, 50))
    if args.part in ("all", "scaling"):
        scaling(max(1, args.rounds // 2), args.steps, args.batch)


if __name__ == "__main__":
    main()

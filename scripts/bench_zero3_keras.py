"""Benchmark Keras ZeRO-3 (shard="parameters") against plain data parallelism and ZeRO-2 in one run: memory and step time.

    flock /tmp/dualframe-bench.lock .venv/bin/python scripts/bench_zero3_keras.py               # np=2 and np=4
    .venv/bin/python scripts/bench_zero3_keras.py --ranks 2 --rounds 5 --width 2048 --layers 5
    .venv/bin/python scripts/bench_zero3_keras.py --ranks 2 --policy mixed_float16   # every mode under the policy
    .venv/bin/python scripts/bench_zero3_keras.py --ranks 2 --time-only --timed plain parameters-keep-0 parameters

For each number of ranks, under mpirun (``--launcher gloo``: horovodrun --gloo), an MLP of ``layers``
Dense(width x width) layers (5 x 2048^2: 21M parameters) with Adam, under Keras's dtype ``--policy``
(default float32; ``mixed_float16``: float32 variables, float16 compute, each mode with its loss scaling:
Keras's LossScaleOptimizer inside the plain wrapper, dualframe's ShardedLossScaleOptimizer when sharded):

memory: one launch per mode (plain ``DistributedOptimizer``, ``shard="gradients"``, ``shard="parameters"``
        through ``distribute``). Each rank reports the bytes it keeps between steps (parameters it holds:
        the model's variables, or its slices under ZeRO-3; the optimizer's slots), its resident memory after
        the steps (``/proc/self/statm``) and its peak (``ru_maxrss``); printed against plain's, beside
        ``dualframe plan``'s figures for the same MLP (its parameters + Adam state, to the byte, and the
        change of its whole per-rank total against plain, to set beside the change of the peak).
time:   one launch holding the models of ``--timed`` (default: the three and ZeRO-3 without prefetch; also
        ZeRO-3 with ``keep_gathered=0``, every layer gathered again and recomputed in its backward, or with
        every layer kept); rounds interleave them (order rotated each round), each times
        ``steps`` fit steps; the median of the per-round ratios to plain (the issue's goal for ZeRO-3: <= 1.3).
"""
from __future__ import annotations

import argparse
import gc
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

MODES = ("plain", "gradients", "parameters")
#: Timed beside MODES: ZeRO-3 with each layer's gather waiting for its own inputs (no prefetch).
TIMED = MODES + ("parameters-no-prefetch",)
#: ZeRO-3 with ``keep_gathered=k`` (the mode above: the default, 1); "all": every layer, none recomputed.
KEPT = ("parameters-keep-0", "parameters-keep-all")


def _model_and_data(width: int, layers: int, batch: int, steps: int, mode: str, policy: str) -> tuple:
    import numpy as np
    import keras
    import dualframe
    import dualframe.tensorflow.keras as hvd

    keras.mixed_precision.set_dtype_policy(policy)  # before the model and its optimizer: compile adds loss scaling
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="relu")
                                                        for _ in range(layers - 1)] + [keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if mode in KEPT:  # as distribute builds ZeRO-3, with keep_gathered= given
        keep = layers if mode.endswith("-all") else int(mode.rsplit("-", 1)[1])
        optimizer = hvd.DistributedOptimizer(model.optimizer, shard="parameters", keep_gathered=keep)
        loss = model.loss
        model = optimizer.shard_model(model)
        model.compile(optimizer=optimizer, loss=loss)
    else:
        shard = "none" if mode == "plain" else mode.replace("-no-prefetch", "")
        model = hvd.distribute(model, dualframe.DataParallel(shard=shard))
    if mode.endswith("-no-prefetch"):
        sharded(model.optimizer)._zero.ahead.prefetch = False  # before fit traces the step
    gc.collect()  # ZeRO-3's distribute returns a copy without values: the given model goes here
    rng = np.random.RandomState(hvd.rank())
    x, y = rng.randn(steps * batch, width).astype("float32"), rng.randint(0, 10, steps * batch)
    model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, verbose=0)  # build and trace outside the timing
    return model, x, y


def sharded(optimizer):
    """The ShardedOptimizer inside ``optimizer`` (a ShardedLossScaleOptimizer's), or None for plain DP."""
    while optimizer is not None and not hasattr(optimizer, "state_bytes"):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return optimizer


def kept_bytes(model) -> dict:
    """Bytes this rank keeps between steps: parameters (the model's, or ZeRO-3's slices) and optimizer slots."""
    import numpy as np

    def size(variables) -> int:
        return sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in variables if len(v.shape))

    optimizer = sharded(model.optimizer)
    if getattr(optimizer, "shard", None) == "parameters":
        parameters = optimizer.parameter_bytes()
    else:
        parameters = size(model.trainable_variables)
    if optimizer is not None:
        return {"parameters": parameters, "slots": int(optimizer.state_bytes())}
    inner = model.optimizer  # plain DP: Adam's slots, inside the wrapper (and Keras's LossScaleOptimizer)
    while hasattr(inner, "inner_optimizer"):
        inner = inner.inner_optimizer
    return {"parameters": parameters, "slots": size(inner.variables)}


def planned(args: argparse.Namespace, ranks: int, mode: str) -> tuple:
    """``dualframe plan``'s figures for this MLP under ``mode``: (parameters + Adam state kept, whole per-rank total)."""
    from dualframe.plan import LayerProfile, ModelProfile, Training, group_memory
    from dualframe.plan.memory import sharded_bytes

    width, shard = args.width, None if mode == "plain" else mode
    sizes = [width * width + width] * (args.layers - 1) + [width * 10 + 10]
    layers = [LayerProfile(f"dense{j}", size, 0, args.batch * width, args.batch * width, args.batch * width)
              for j, size in enumerate(sizes)]
    profile = ModelProfile("keras", "mlp", (width,), layers, input_elements=width)
    parameters, _, state = sharded_bytes(sum(sizes) * 4.0, 2, shard, ranks)
    total = group_memory(profile, range(len(layers)), Training(args.batch, optimizer="adam"), replicas=ranks,
                         shard=shard).total
    return parameters + state, total


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(part: str, mode: str, args: argparse.Namespace) -> None:
    """Under a launcher: rank 0 prints one RESULT line of JSON."""
    import tensorflow as tf
    import dualframe.tensorflow.keras as hvd

    hvd.init()
    if part == "memory":
        model, x, y = _model_and_data(args.width, args.layers, args.batch, args.steps, mode, args.policy)
        model.fit(x, y, batch_size=args.batch, shuffle=False, verbose=0)
        gc.collect()
        kept = kept_bytes(model)
        row = [kept["parameters"], kept["slots"], resident(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]
        values = hvd.allgather(tf.constant([row], dtype=tf.int64)).numpy().max(axis=0)
        result = dict(zip(("parameters", "slots", "resident", "peak"), (int(v) for v in values)))
    else:
        timed = args.timed
        models = {m: _model_and_data(args.width, args.layers, args.batch, args.steps, m, args.policy) for m in timed}
        result = {m: [] for m in timed}
        for k in range(args.rounds):
            for m in timed[k % len(timed):] + timed[:k % len(timed)]:  # the first in a round pays for waking up
                model, x, y = models[m]
                hvd.barrier()
                start = time.perf_counter()
                model.fit(x, y, batch_size=args.batch, shuffle=False, verbose=0)
                result[m].append(float(hvd.allreduce(tf.constant((time.perf_counter() - start) / args.steps),
                                                     op=hvd.Max)))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def launch(ranks: int, part: str, mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **thread_env(ranks, cores=ranks))
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env['PATH']}"
    program = [sys.executable, __file__, "--worker", part, "--mode", mode, "--width", str(args.width),
               "--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
               "--rounds", str(args.rounds), "--policy", args.policy, "--timed", *args.timed]
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
        memory = {m: launch(ranks, "memory", m, args) for m in MODES}
        plain = memory["plain"]
        print(f"np={ranks} {args.launcher}, {args.layers} x Dense({args.width}), Adam, policy {args.policy}; "
              f"per rank (max over ranks):")
        plan_plain = planned(args, ranks, "plain")[1]
        for m in MODES:
            row = memory[m]
            kept, base = row["parameters"] + row["slots"], plain["parameters"] + plain["slots"]
            plan_kept, plan_total = planned(args, ranks, m)
            print(f"  {m:10s} parameters + slots kept {kept / 2**20:7.1f} MiB ({kept / base:.3f} of plain; "
                  f"1/np = {1 / ranks:.3f}; plan {plan_kept / 2**20:.1f} MiB, measured/plan {kept / plan_kept:.3f}), "
                  f"resident after the steps {row['resident'] / 2**20:7.1f} MiB "
                  f"({(row['resident'] - plain['resident']) / 2**20:+.1f} MiB against plain), peak "
                  f"{row['peak'] / 2**20:7.1f} MiB ({(row['peak'] - plain['peak']) / 2**20:+.1f} MiB; the plan's "
                  f"total {(plan_total - plan_plain) / 2**20:+.1f} MiB against plain)", flush=True)
    times = launch(ranks, "time", "all", args)
    base = statistics.median(times["plain"])
    for m in args.timed[1:]:
        ratios = [t / p for t, p in zip(times[m], times["plain"])]
        print(f"  np={ranks} {args.launcher} step time shard={m!r}: {statistics.median(times[m]) * 1e3:.1f} ms vs "
              f"plain {base * 1e3:.1f} ms, ratio {statistics.median(ratios):.3f} (median of {args.rounds} "
              f"interleaved rounds: {' '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    for mode, other, what in (("parameters", "parameters-no-prefetch", "with prefetch / without"),
                              ("parameters", "parameters-keep-0", "keep_gathered=1 (default) / 0"),
                              ("parameters-keep-all", "parameters-keep-0", "keep_gathered=every layer / 0")):
        if mode in times and other in times:
            ratios = [a / b for a, b in zip(times[mode], times[other])]
            print(f"  np={ranks} ZeRO-3 {what}: {statistics.median(ratios):.3f} "
                  f"({' '.join(f'{r:.2f}' for r in ratios)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--launcher", choices=["mpirun", "gloo"], default="mpirun")
    parser.add_argument("--policy", choices=["float32", "mixed_float16", "mixed_bfloat16"], default="float32",
                        help="Keras's global dtype policy for every mode")
    parser.add_argument("--time-only", action="store_true", help="skip the memory launches")
    parser.add_argument("--timed", nargs="+", choices=TIMED + KEPT, default=list(TIMED),
                        help="the modes timed in one launch, plain first (ratios are to it)")
    parser.add_argument("--worker", choices=["memory", "time"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mode, args)
        return
    print(f"load average {os.getloadavg()[0]:.2f} at start", flush=True)
    for ranks in args.ranks:
        report(ranks, args)
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()

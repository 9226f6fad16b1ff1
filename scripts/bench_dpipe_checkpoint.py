"""A process pipeline's stage memory and step time with activation checkpointing (checkpoint=) and without, in one run.

    OMP_NUM_THREADS=1 .venv/bin/horovodrun -np 2 -H localhost:2 --gloo \\
        .venv/bin/python scripts/bench_dpipe_checkpoint.py --framework torch
    (the same with --framework keras)

A chain of ``blocks`` x (Linear/Dense(width, width), ReLU) per stage, 2 stages (one per process),
GPipe, ``chunks`` micro-batches, one thread per process. Per checkpoint mode, each rank measures its
stage's peak activation bytes during a step: torch, autograd's saved tensors plus the inputs a
checkpointed micro-batch keeps (the pipeline's ``ActivationMeter``); Keras, the growth of TensorFlow's CPU
allocator's peak over the step (``TF_CPU_ALLOCATOR_USE_BFC=true``, ``get_memory_info``: every tensor,
weights' gradients and transient buffers included); both frameworks, the growth of the
process's resident set over a step (peak RSS, reset before the step through /proc/self/clear_refs,
with glibc's mmap threshold at 64 KiB meanwhile, so a freed tensor goes back to the system and the
resident set follows what is alive). Beside them, ``dualframe plan``'s activation arithmetic for that
stage (``group_memory``). Then, with the threshold at 32 MiB (no page faults per tensor), step seconds,
the modes taking turns (A B A B, median) and their ratio to "never".
"""
import argparse
import ctypes
import os
import statistics
from typing import Any, Callable, Dict, List, Tuple

import bench_env

bench_env.one_thread_per_process()

MODES = ("never", "except_last", "always")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def mmap_threshold(nbytes: int) -> None:
    """glibc's malloc: blocks of ``nbytes`` or more are mapped (and unmapped when freed); trims above it.

    Set before the tensors of the measured steps exist: a freed block already in the heap would
    otherwise serve them without the resident set growing."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, nbytes)
    libc.mallopt(M_TRIM_THRESHOLD, nbytes)
    libc.malloc_trim(0)


def peak_rss_growth(step: Callable[[], Any]) -> float:
    """Bytes the resident set grew to, above where it stood, while ``step()`` ran."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _status("VmRSS")
    step()
    return _status("VmHWM") - before


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return float(line.split()[1]) * 1024


def plan_bytes(profile: Any, stage: range, batch: int, chunks: int, mode: str) -> float:
    """``dualframe plan``'s activation bytes for the layers of ``stage`` under ``mode``."""
    from dualframe.plan import Training, group_memory
    return group_memory(profile, stage, Training(batch, "sgd"), chunks, mode).activations


def torch_pipelines(args: argparse.Namespace) -> Tuple[Dict[str, Any], Callable[[Any], Callable[[], Any]], Any]:
    import torch
    from torch import nn
    from bench_torch import linear_relu
    torch.set_num_threads(1)
    import dualframe.torch as hvd
    from dualframe.torch.pipeline.distributed import DistributedPipeline
    from dualframe.torch.plan.probe import profile_module

    hvd.init()
    model = linear_relu(args.width, args.blocks * 2)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    pipes = {mode: DistributedPipeline(linear_relu(args.width, args.blocks * 2), [args.blocks * 2] * 2,
                                       chunks=args.chunks, loss_fn=nn.MSELoss(), checkpoint=mode) for mode in MODES}
    optimizers = {mode: torch.optim.SGD(pipe.parameters(), lr=1e-4) for mode, pipe in pipes.items()}

    def stepper(mode: str) -> Callable[[], Any]:
        def step() -> None:
            optimizers[mode].zero_grad()
            pipes[mode].train_step(x, y)
            optimizers[mode].step()
        return step
    return pipes, stepper, (profile_module(model, (args.width,)), hvd)


def keras_pipelines(args: argparse.Namespace) -> Tuple[Dict[str, Any], Callable[[Any], Callable[[], Any]], Any]:
    import keras
    import numpy as np
    import dualframe.tensorflow as hvd
    from dualframe.tensorflow.pipeline.distributed import DistributedPipeline
    from dualframe.tensorflow.plan.probe import profile_model

    hvd.init()

    def model() -> Any:
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((args.width,))] + [keras.layers.Dense(args.width, activation="relu")
                                                                for _ in range(args.blocks * 2)])
    rng = np.random.RandomState(0)
    x, y = (rng.randn(args.batch, args.width).astype("float32") for _ in range(2))
    pipes = {mode: DistributedPipeline(model(), [args.blocks] * 2, chunks=args.chunks, loss_fn="mse", checkpoint=mode)
             for mode in MODES}
    optimizers = {mode: keras.optimizers.SGD(1e-4) for mode in MODES}

    def stepper(mode: str) -> Callable[[], Any]:
        def step() -> None:
            pipes[mode].train_step(x, y)
            pipes[mode].apply_gradients(optimizers[mode])
        return step
    return pipes, stepper, (profile_model(model(), (args.width,)), hvd)


def allocator_peak(step: Callable[[], Any]) -> float:
    """Bytes TensorFlow's CPU allocator held at its peak during ``step()``, above what it held before."""
    import tensorflow as tf
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step()
    return float(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)


def measured_peaks(pipes: Dict[str, Any], stepper: Callable[[str], Callable[[], Any]],
                   args: argparse.Namespace) -> Tuple[Dict[str, float], Dict[str, List[float]]]:
    """Per mode, the last round's framework figure (torch: the meter; Keras: the allocator) and each round's RSS."""
    rss: Dict[str, List[float]] = {mode: [] for mode in MODES}
    framework: Dict[str, float] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            if args.framework == "torch":
                pipes[mode].meter.reset_peak()
                rss[mode].append(peak_rss_growth(stepper(mode)))
                framework[mode] = pipes[mode].meter.peak_bytes
            else:  # the allocator's figure taken inside the step the resident set is measured over
                peaks: List[float] = []
                rss[mode].append(peak_rss_growth(lambda: peaks.append(allocator_peak(stepper(mode)))))
                framework[mode] = peaks[0]
    return framework, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "keras"), default="torch")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4, help="(layer, ReLU) pairs per stage (Keras: Dense(relu) x 2)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    if args.framework == "keras":  # TensorFlow's CPU allocator keeps statistics only as a BFC allocator
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    build = torch_pipelines if args.framework == "torch" else keras_pipelines
    mmap_threshold(64 * 1024)
    pipes, stepper, (profile, hvd) = build(args)
    for mode in MODES:  # warm-up: first-step tracing and allocations
        stepper(mode)(), stepper(mode)()
    meter, rss = measured_peaks(pipes, stepper, args)
    mmap_threshold(32 * 2**20)
    import bench_common
    times = bench_common.interleaved_steps({mode: stepper(mode) for mode in MODES}, (), args.steps, args.rounds,
                                           hvd.barrier)
    j = pipes["never"].stage_index
    per_stage = profile.num_layers // 2
    stage = range(j * per_stage, (j + 1) * per_stage)
    mine = {mode: (meter.get(mode), statistics.median(rss[mode]),
                   plan_bytes(profile, stage, args.batch, args.chunks, mode), statistics.median(times[mode]) / args.steps)
            for mode in MODES}
    report(hvd, args, mine)


def report(hvd: Any, args: argparse.Namespace, mine: Dict[str, Tuple[Any, float, float, float]]) -> None:
    """Rank 0 prints one line per stage and mode: MiB measured, MiB planned, seconds per step and its ratio."""
    stages = hvd.allgather_object(mine)
    if hvd.rank() != 0:
        return
    mib = 2.0 ** 20
    print(f"{args.framework}: 2 stages x {args.blocks} x (Linear/Dense {args.width}, ReLU), batch {args.batch}, "
          f"chunks {args.chunks}, GPipe, 1 thread per process, {args.rounds} rounds (median)")
    for j, rows in enumerate(stages):
        for mode, (metered, rss, planned, seconds) in rows.items():
            what = "meter" if args.framework == "torch" else "allocator peak growth"
            counted = f"{what} {metered / mib:7.1f} MiB, " if metered is not None else ""
            print(f"stage {j} {mode:<11} {counted}peak RSS growth {rss / mib:7.1f} MiB, plan {planned / mib:7.1f} MiB, "
                  f"step {seconds:.3f} s ({seconds / rows['never'][3]:.2f} x never)", flush=True)


if __name__ == "__main__":
    main()

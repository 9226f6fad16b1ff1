"""Benchmark of Keras 3 pipelines whose stages are processes (2 stages, one thread per process); the TF twin of bench_dist_pipeline.py.

    flock /tmp/dualframe-bench.lock mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none \\
        -x OMP_NUM_THREADS=1 -x TF_NUM_INTRAOP_THREADS=1 -x TF_NUM_INTEROP_THREADS=1 -x PATH \\
        .venv/bin/python scripts/bench_dist_pipeline_tf.py
    OMP_NUM_THREADS=1 flock /tmp/dualframe-bench.lock horovodrun -np 2 -H localhost:2 --gloo \\
        .venv/bin/python scripts/bench_dist_pipeline_tf.py

The same model family (blocks x (Dense(width), ReLU)), batch and method as the PyTorch script, the
rounds and report lines from ``dualframe.observe.bench_rounds``. Prints, from interleaved rounds (A B A B ...,
median of the per-round ratios):
  1. throughput of DistributedPipeline chunks=8 over chunks=1 (naive model parallelism at its fastest:
     ``jit_compile=False``, TensorFlow's own kernels), GPipe and 1F1B compiled with XLA (the default),
     GPipe without XLA, and chunks=1 with XLA; where the messages go point-to-point (MPI under
     mpirun, ZeroMQ under horovodrun --gloo: the default), also GPipe's chunks=8 / chunks=1 with
     them as Horovod broadcasts, in the same rounds; then the seconds per step, the steady
     state: each configuration runs one warm-up step (traces, XLA compilation, shape headers) before
     the rounds, and a round's seconds are divided by its steps;
  2. the measured bubble (the pipeline's: 1 - mean stage busy / longest stage step,
     ``dualframe.pipeline.walk.pipeline_bubble``) against (n-1)/(m+n-1) for m = 1..16,
     with the walk's seconds (the longest stage's schedule, without the step agreement, loss and
     optimizer that the timed steps above include) and computing seconds per stage (what
     micro-batching costs vs what waiting costs), the first of 1 + steps steps left out;
  3. per rank, the most micro-batches held at once (tapes; on the last stage, a micro-batch run in
     one compiled call holds only its input's gradient), gpipe vs 1f1b (chunks=8), and at most the
     layer outputs they hold (computed: held x rows x width x 4 bytes x layers of the stage; Keras
     on a CPU has no allocator statistics to read);
  4. ZB-H1 against 1F1B at chunks=8 in their own interleaved rounds (both compiled with XLA): throughput
     zb-h1 / 1f1b, each one's measured bubble beside its theory ((n-1)/(m+n-1) and (n-1)/(3m+n-1)) and
     the computing seconds per stage (ZB-H1's B re-runs each layer from its kept input, so it may compute
     more: ``dualframe.tensorflow.pipeline.graph_backward``), and the micro-batches each holds at once.
  Part 1 also times GPipe with each micro-batch's weight gradient in its own backward (``W per
  micro-batch``, as before GPipe batched its W passes: ``dualframe.pipeline.schedule.batched_weights``), and prints
  chunks=8 / that in the same rounds; and chunks=1 the same way (``chunks=1 one backward``: each stage
  one tape backward, its input's gradient sent after its weights' as in torch's chunks=1, the
  baseline when issue 16 was filed), with chunks=8 and 1F1B over it. The ``chunks=1`` baseline above
  sends the input's gradient before the weights' (GPipe's split passes), so the last stage's W
  overlaps the first stage's B even without micro-batches.
  ``--only-zb`` runs part 4 alone; ``--only-ratios`` part 1 alone (what bench_dist_pipeline_launchers.py reads).
"""
import statistics

import bench_env

bench_env.one_thread_per_process()

import keras  # noqa: E402

import bench_common  # noqa: E402
import dualframe.tensorflow as hvd  # noqa: E402
from bench_keras import random_xy, zb_against_1f1b  # noqa: E402
from dualframe.observe.bench_rounds import bubble_line, ratio_line  # noqa: E402
from dualframe.pipeline.walk import pipeline_bubble  # noqa: E402
from dualframe.tensorflow.pipeline.distributed import DistributedPipeline  # noqa: E402


def build_model(width: int, blocks: int) -> keras.Sequential:
    keras.utils.set_random_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [keras.layers.Dense(width), keras.layers.ReLU()]
    return keras.Sequential([keras.Input((width,))] + layers)


def ours(model, chunks, schedule="gpipe", transport="auto", jit_compile=True, batch_weights=True):
    half = len(model.layers) // 2
    pipe = DistributedPipeline(model, [half, half], chunks=chunks, schedule=schedule, loss_fn="mse",
                               jit_compile=jit_compile, transport=transport)
    pipe.batch_weights = batch_weights
    optimizer = keras.optimizers.SGD(1e-4)

    def step(x, y):
        pipe.train_step(x, y)
        pipe.apply_gradients(optimizer)
    return pipe, step


def memory_line(model, schedule, x, y, chunks, width):
    pipe, step = ours(model, chunks, schedule)
    step(x, y)
    step(x, y)
    rows = -(-len(x) // chunks)
    mib = pipe.peak_live * rows * width * 4 * sum(len(stage.layers) for stage in pipe.layers) / 2**20
    peaks = hvd.allgather_object((pipe.peak_live, mib))
    return (f"peak micro-batches held per rank, {schedule}, chunks={chunks}: "
            + ", ".join(f"rank {r} {held} (at most {m:.1f} MiB of layer outputs)" for r, (held, m) in enumerate(peaks)))


def zero_bubble_report(model, x, y, rounds, steps):
    """Part 4: zb-h1 against 1f1b at chunks=8, interleaved rounds, measured bubbles."""
    transport, report = zb_against_1f1b(lambda m, schedule: ours(model, m, schedule), x, y, 8, rounds, steps)
    return [f"zb-h1 against 1f1b, messages over {transport}"] + report


def main() -> None:
    parser = bench_common.parser(__doc__, only_parts=True, width=512, blocks=12, batch=2048, rounds=5, steps=2)
    args = parser.parse_args()
    bench_common.init_two_processes(hvd)
    x, y = random_xy(args.batch, args.width)
    model = build_model(args.width, args.blocks)
    model_text = f"Keras {keras.__version__}: {args.blocks} x (Dense({args.width}), ReLU)"
    header = bench_common.two_stage_header(model_text, args)
    if args.only_zb:
        bench_common.print_report(hvd.rank(), header, zero_bubble_report(model, x, y, args.rounds, args.steps))
        return
    naive, naive_step = ours(model, 1)
    transport = naive.transport
    # "chunks=1" is our fastest chunks=1: TensorFlow's own kernels (no XLA), which beat XLA's at 2048
    # rows here, and GPipe's split backward (the input's gradient sent before the weights'); "chunks=1
    # one backward" is naive model parallelism (one tape backward per stage, as torch's chunks=1). The
    # pipelines are compiled with XLA (the default), which keeps its speed per row at 256 rows where
    # TensorFlow's kernels slow down.
    configs = {"chunks=1": ours(model, 1, jit_compile=False)[1], "chunks=8": ours(model, 8)[1],
               "chunks=8 1f1b": ours(model, 8, "1f1b")[1], "chunks=8 no XLA": ours(model, 8, jit_compile=False)[1],
               "chunks=1 XLA": naive_step, "chunks=8 W per micro-batch": ours(model, 8, batch_weights=False)[1],
               "chunks=1 one backward": ours(model, 1, jit_compile=False, batch_weights=False)[1]}
    if transport != "horovod":  # point-to-point: the same pipelines with Horovod broadcasts, side by side
        configs["chunks=1 Horovod broadcasts"] = ours(model, 1, transport="horovod", jit_compile=False)[1]
        configs["chunks=8 Horovod broadcasts"] = ours(model, 8, transport="horovod")[1]
    for step in configs.values():  # warm-up, not timed: traces, XLA compilation, shape headers
        step(x, y)
    times = bench_common.interleaved_steps(configs, (x, y), args.steps, args.rounds, hvd.barrier)
    report = [ratio_line(f"{name} / chunks=1", times["chunks=1"], times[name])
              for name in ("chunks=8", "chunks=8 1f1b", "chunks=8 no XLA", "chunks=1 XLA", "chunks=8 W per micro-batch")]
    report.append(ratio_line("chunks=8 / chunks=8 W per micro-batch", times["chunks=8 W per micro-batch"],
                             times["chunks=8"]))
    for name in ("chunks=8", "chunks=8 1f1b"):
        report.append(ratio_line(f"{name} / chunks=1 one backward", times["chunks=1 one backward"], times[name]))
    if "chunks=8 Horovod broadcasts" in times:
        report.append(ratio_line("chunks=8 / chunks=1, Horovod broadcasts", times["chunks=1 Horovod broadcasts"],
                                 times["chunks=8 Horovod broadcasts"]))
    report.append(bench_common.per_step_line(times, args.steps,
                                             "seconds per step (median over rounds, after 1 warm-up step each)"))
    if args.only_ratios:
        bench_common.print_report(hvd.rank(), f"{header}, messages over {transport}", report)
        return
    bubbles = bench_common.bubbles_by_chunks(lambda m: ours(model, m), x, y, args.steps, hvd.allgather_object)
    for m, busy, walls in bubbles:
        report.append(bubble_line(m, pipeline_bubble(busy, walls))
                      + f"; walk {max(walls):.3f} s, computing {statistics.mean(busy):.3f} s per stage")
    report += [memory_line(model, schedule, x, y, 8, args.width) for schedule in ("gpipe", "1f1b")]
    report += zero_bubble_report(model, x, y, args.rounds, args.steps)
    bench_common.print_report(hvd.rank(), f"{header}, messages over {transport}", report)


if __name__ == "__main__":
    main()

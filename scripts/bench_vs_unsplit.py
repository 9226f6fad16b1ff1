"""The user's question: is a 2-process pipeline faster than not splitting at all? Both frameworks, two models.

    flock /tmp/dualframe-bench.lock mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none \\
        -x OMP_NUM_THREADS=1 -x TF_NUM_INTRAOP_THREADS=1 -x TF_NUM_INTEROP_THREADS=1 -x PATH \\
        .venv/bin/python scripts/bench_vs_unsplit.py --framework torch --model dense   # keras | encoder

In interleaved rounds (A B C A B C ..., median of the per-round ratios), one thread per process:
  - ``unsplit``: the whole model trained in ONE process (rank 0; rank 1 waits in a Horovod barrier):
    torch ``loss.backward()`` + SGD, Keras ``compile`` + ``train_on_batch`` (Keras decides XLA, as users get);
  - ``chunks=1`` and ``chunks=8``: ``DistributedPipeline`` over the two processes, one stage each (GPipe).
Prints chunks=8 and chunks=1 over the unsplit step (the goals: >= 1.5 Keras, >= 1.6 torch for chunks=8), the
seconds per step, and each stage's computing seconds at chunks=1 beside half the unsplit step (a stage's
compute against the same layers run unsplit; the halves are balanced by layer count).
Models: ``dense`` is 12 x (Dense/Linear(512), ReLU), batch 2048; ``encoder`` is 4 Transformer encoder
blocks (dim 128, 4 heads, length 64, batch 64; torch ``nn.TransformerEncoderLayer``, Keras
``keras_hub.layers.TransformerEncoder``), a mean-squared loss on the output.
"""
import argparse
import statistics

import bench_env

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--framework", choices=("torch", "keras"), default="torch")
ARGS.add_argument("--model", choices=("dense", "encoder"), default="dense")
ARGS.add_argument("--rounds", type=int, default=7)
ARGS.add_argument("--steps", type=int, default=3)
ARGS.add_argument("--jit-compile", choices=("auto", "true", "false"), default="auto",
                  help="Keras pipelines' jit_compile: auto (None, chosen per stage), True or False")


def torch_arms(model_name):
    import bench_common
    import torch
    from torch import nn

    import dualframe.torch as hvd
    from dualframe.torch.pipeline.distributed import DistributedPipeline

    bench_common.init_two_processes(hvd)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model_name == "dense":
        layers = [m for _ in range(12) for m in (nn.Linear(512, 512), nn.ReLU())]
        x, y = torch.randn(2048, 512), torch.randn(2048, 512)
    else:
        layers = [nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True) for _ in range(4)]
        x, y = torch.randn(64, 64, 128), torch.randn(64, 64, 128)
    model = nn.Sequential(*layers)
    loss_fn = nn.MSELoss()

    def trainer(module, call):
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad()
            call()
            optimizer.step()
        return step

    def unsplit_call():
        loss_fn(model(x), y).backward()

    arms, pipes = {}, {}
    if hvd.rank() == 0:
        arms["unsplit"] = trainer(model, unsplit_call)
    for chunks in (1, 8):
        pipe = DistributedPipeline(model, [len(layers) // 2] * 2, chunks=chunks, loss_fn=loss_fn)
        pipes[chunks] = pipe
        arms[f"chunks={chunks}"] = trainer(pipe, lambda pipe=pipe: pipe.train_step(x, y))
    return hvd, arms, pipes


def keras_arms(model_name, jit_compile="auto"):
    import bench_common
    import keras
    import numpy as np

    import dualframe.tensorflow as hvd
    from dualframe.tensorflow.pipeline.distributed import DistributedPipeline

    bench_common.init_two_processes(hvd)
    keras.utils.set_random_seed(0)
    if model_name == "dense":
        layers = [m for _ in range(12) for m in (keras.layers.Dense(512), keras.layers.ReLU())]
        shape, batch = (512,), 2048
    else:
        import keras_hub
        layers = [keras_hub.layers.TransformerEncoder(512, 4, dropout=0.0) for _ in range(4)]
        shape, batch = (64, 128), 64
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + shape).astype("float32")
    y = rng.standard_normal((batch,) + shape).astype("float32")
    model = keras.Sequential([keras.Input(shape)] + layers)
    arms, pipes = {}, {}
    if hvd.rank() == 0:
        unsplit = keras.models.clone_model(model)
        unsplit.set_weights(model.get_weights())
        unsplit.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        arms["unsplit"] = lambda: unsplit.train_on_batch(x, y)
    for chunks in (1, 8):
        pipe = DistributedPipeline(model, [len(layers) // 2] * 2, chunks=chunks, loss_fn="mse",
                                   jit_compile={"auto": None, "true": True, "false": False}[jit_compile])
        optimizer = keras.optimizers.SGD(1e-4)
        pipes[chunks] = pipe

        def step(pipe=pipe, optimizer=optimizer):
            pipe.train_step(x, y)
            pipe.apply_gradients(optimizer)
        arms[f"chunks={chunks}"] = step
    return hvd, arms, pipes


def timed(hvd, step, steps, alone):
    """Seconds of ``steps`` steps between two barriers (``alone``: rank 0 steps, rank 1 only waits)."""
    import time

    hvd.barrier()
    start = time.perf_counter()
    if not alone or hvd.rank() == 0:
        for _ in range(steps):
            step()
    hvd.barrier()
    return time.perf_counter() - start


def main() -> None:
    args = ARGS.parse_args()
    bench_env.one_thread_per_process(tensorflow=args.framework == "keras")
    hvd, arms, pipes = torch_arms(args.model) if args.framework == "torch" else keras_arms(args.model, args.jit_compile)
    from dualframe.observe.bench_rounds import interleaved, ratio_line, seconds_line

    names = ["unsplit", "chunks=1", "chunks=8"]
    for name in names:  # warm-up: traces, allocator, shape headers
        timed(hvd, arms.get(name), 1, name == "unsplit")
    times = interleaved({name: (lambda name=name: timed(hvd, arms.get(name), args.steps, name == "unsplit"))
                         for name in names}, args.rounds)
    busy = hvd.allgather_object(pipes[1].records.mean_busy())  # the warm-up step is left out
    if hvd.rank() != 0:
        return
    per_step = {name: [t / args.steps for t in ts] for name, ts in times.items()}
    half = statistics.median(per_step["unsplit"]) / 2
    print(f"{args.framework} {args.model}: 2 processes x 1 thread against one process x 1 thread, "
          f"{args.rounds} rounds of {args.steps} steps")
    for name in ("chunks=8", "chunks=1"):
        print(ratio_line(f"{name} / unsplit", times["unsplit"], times[name]))
    print(seconds_line(per_step))
    print("chunks=1 computing s per stage: " + ", ".join(f"{b:.3f}" for b in busy)
          + f"; half the unsplit step {half:.3f} (stage / half: "
          + ", ".join(f"{b / half:.2f}" for b in busy) + ")")


if __name__ == "__main__":
    main()

"""A Keras pipeline stage's passes against ``train_on_batch`` of the same layers, in one process, CPU seconds.

    .venv/bin/python scripts/bench_stage_cpu_tf.py --model encoder   # dense

One thread; ``time.process_time`` per step (holds under load from other processes). Arms, each with XLA
on and off: ``unsplit``: ``compile`` + ``train_on_batch`` of half the model's layers (one stage's worth);
``first c=1`` / ``first c=8``: the first stage's ``TFGraphStageWork`` forward and backward of every micro-batch
(GPipe's order) as ``DistributedPipeline`` runs a chain's stage (a graph stage; messages packed and unpacked
as they cross); ``last c=1`` / ``last c=8``: the last stage's.
Models as in ``scripts/bench_vs_unsplit.py``, half of them: 6 x (Dense(512), ReLU) at batch 2048, or 2
``keras_hub.layers.TransformerEncoder`` blocks (dim 128, length 64, batch 64).
"""
import argparse
import statistics
import time

import bench_env

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--model", choices=("dense", "encoder"), default="encoder")
ARGS.add_argument("--steps", type=int, default=5)
ARGS.add_argument("--arms", default="unsplit,first,last")
ARGS.add_argument("--split-blocks", action="store_true",
                  help="batch W passes on any splittable stage (the choice before reruns_cheaply)")


def make_layers(model_name):
    import keras
    if model_name == "dense":
        return [m for _ in range(6) for m in (keras.layers.Dense(512), keras.layers.ReLU())], (512,), 2048
    import keras_hub
    return [keras_hub.layers.TransformerEncoder(512, 4, dropout=0.0) for _ in range(2)], (64, 128), 64


def cpu_per_step(step, steps):
    step()  # traces, compiles
    times = []
    for _ in range(steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def unsplit_arm(model_name, jit, x, y):
    import keras
    layers, shape, _ = make_layers(model_name)
    model = keras.Sequential([keras.Input(shape)] + layers)
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse", jit_compile=jit)
    return lambda: model.train_on_batch(x, y)


def stage_arm(model_name, jit, x, y, first, chunks, split_blocks=False):
    import keras
    import tensorflow as tf

    from dualframe.pipeline.action import Action, fusable
    from dualframe.pipeline.graph_walk import edge_values
    from dualframe.pipeline.schedule import deferred_weights
    from dualframe.tensorflow.graph.capture import capture
    from dualframe.tensorflow.pipeline.compiled import GraphStageFunction
    from dualframe.tensorflow.pipeline.graph import process_stages
    from dualframe.tensorflow.pipeline.graph_work import TFGraphStageWork
    from dualframe.tensorflow.pipeline.message import pack
    from dualframe.tensorflow.pipeline.xla import use_xla
    layers, shape, batch = make_layers(model_name)
    keras.Sequential([keras.Input(shape)] + layers)  # builds them
    use = use_xla(jit, layers, "/CPU:0")
    loss = keras.losses.get("mse")
    # The stage as DistributedPipeline holds it: stage 0 (first) or 1 (last) of a chain cut as a graph.
    other = keras.layers.Identity()
    chain = layers + [other] if first else [other] + layers
    captured = capture(chain)
    split, stages = process_stages(captured, balance=[len(layers), 1] if first else [1, len(layers)])
    j = 0 if first else 1
    function = GraphStageFunction(stages[j], split, j, captured, loss, use)
    plan = [Action.parse(f"F{i}") for i in range(chunks)] + [Action.parse(f"B{i}") for i in reversed(range(chunks))]
    passes = function.passes
    batched = passes.splittable() and (split_blocks or (passes.reruns_cheaply() and passes.batchable()))
    if batched:  # as DistributedPipeline's GPipe
        plan = deferred_weights(plan)
    xs, ys = tf.split(tf.constant(x), chunks), tf.split(tf.constant(y), chunks)
    names = edge_values(split, 0, 1)
    received = [{-1: {split.graph.inputs[0]: part}} if first else {0: pack([part], names)} for part in xs]
    grads = [{1: pack([tf.ones_like(part) * 1e-3], names)} if first else {} for part in xs]

    def step():
        work = TFGraphStageWork(stages[j], split, j, captured, loss, [] if first else list(ys), [1 / chunks] * chunks,
                                "/CPU:0", function, split_backward=batched, fused=fusable(plan), batch_weights=batched)
        for action in plan:
            if action.kind == "F":
                work.forward(action.micro, received[action.micro])
            elif action.kind == "B":
                work.backward(action.micro, grads[action.micro])
            else:
                work.weight(action.micro)
        return work.gradients
    return step, use


def main():
    args = ARGS.parse_args()
    bench_env.one_thread_per_process()
    import numpy as np
    _, shape, batch = make_layers(args.model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + shape).astype("float32")
    y = rng.standard_normal((batch,) + shape).astype("float32")
    arms = args.arms.split(",")
    for jit in (True, False, None):
        results = []
        if "unsplit" in arms and jit is not None:
            results.append(("unsplit", cpu_per_step(unsplit_arm(args.model, jit, x, y), args.steps)))
        for first in (True, False):
            if ("first" if first else "last") not in arms:
                continue
            for chunks in (1, 8):
                step, use = stage_arm(args.model, jit, x, y, first, chunks, args.split_blocks)
                results.append((f"{'first' if first else 'last'} c={chunks} (xla {use})",
                                cpu_per_step(step, args.steps)))
        print(f"{args.model} jit_compile={jit}: " + ", ".join(f"{n} {s:.3f}" for n, s in results), flush=True)


if __name__ == "__main__":
    main()

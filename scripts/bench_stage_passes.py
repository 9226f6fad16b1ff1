"""What one pipeline stage's passes cost, one process: F, B, W of the split backward against F and the whole backward.

    .venv/bin/python scripts/bench_stage_passes.py                      # --framework keras

One stage as ``bench_vstages.py``'s zb-v cuts it (``--blocks`` x (Linear/Dense(width), ReLU), 3 blocks: 6
layers, a quarter of the 12-block model) on ``--chunks`` micro-batches of ``--rows`` rows (2048 / 8), one
thread. Prints the process's CPU ms per micro-batch (``time.process_time``: steadier than wall time on a
shared box), medians of interleaved rounds (each round: every micro-batch's F, then every B, then every W,
as a schedule runs them):

* ``work``: the stage work the pipeline runs for a middle stage (messages unpacked and packed, ``F i`` /
  ``B i`` / ``W i`` as ``DistributedPipeline`` calls them), split (zb-h1, zb-v) and whole (1f1b);
* torch only, ``passes``: the same passes without messages: F (recording for the split), B
  (``SplitBackward.input_pass``), W (``weight_pass``) against the whole ``autograd.backward``;
* ``pack``: one micro-batch's message packed and unpacked.
"""
import argparse
import statistics
import time
from typing import Callable, Dict, List

import bench_env

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--framework", choices=("torch", "keras"), default="torch")
ARGS.add_argument("--width", type=int, default=512)
ARGS.add_argument("--blocks", type=int, default=3)
ARGS.add_argument("--rows", type=int, default=256)
ARGS.add_argument("--chunks", type=int, default=8)
ARGS.add_argument("--rounds", type=int, default=9)

#: A round's phases: name -> one call per micro-batch i (a phase runs after the one before for every i).
Phases = Dict[str, Callable[[int], object]]


def timed(phases: Callable[[], Phases], chunks: int, seconds: Dict[str, List[float]]) -> None:
    """One round: each phase for micro-batches 0..chunks-1 in turn, its ms per micro-batch added to ``seconds``."""
    for name, call in phases().items():
        start = time.process_time()
        for i in range(chunks):
            call(i)
        seconds.setdefault(name, []).append((time.process_time() - start) * 1e3 / chunks)


def torch_arms(args) -> Dict[str, Callable[[], Phases]]:
    import torch
    from bench_torch import linear_relu
    from dualframe.pipeline.graph import chain_split
    from dualframe.torch.graph.chain import ChainStage
    from dualframe.torch.pipeline.activation_meter import ActivationMeter
    from dualframe.torch.pipeline.backward import SplitBackward
    from dualframe.torch.pipeline.graph_work import HeldStageWorks, pack, unpack

    torch.set_num_threads(1)
    stage = linear_relu(args.width, args.blocks)
    call = ChainStage(stage)
    xs = [torch.randn(args.rows, args.width) for _ in range(args.chunks)]
    gs = [torch.randn(args.rows, args.width) for _ in range(args.chunks)]
    split = chain_split(3)
    device = torch.device("cpu")
    meter = ActivationMeter(stage.parameters())
    helds = {s: HeldStageWorks({1: stage}, split, lambda o: o["x2"], device, chain=True, split_backward=s,
                               recomputed=frozenset()) for s in (False, True)}
    x_msgs = [pack([x], ["x1"], device) for x in xs]
    g_msgs = [pack([g], ["x2"], device) for g in gs]

    def work(split_backward: bool) -> Phases:
        w = helds[split_backward].works(torch.nn.MSELoss(), [], [1.0] * args.chunks, meter)[1]
        phases: Phases = {"F": lambda i: w.forward(i, {0: x_msgs[i]}), "B": lambda i: w.backward(i, {2: g_msgs[i]})}
        if split_backward:
            phases["W"] = w.weight
        return {name: _counting(meter, f) for name, f in phases.items()}

    def passes_whole() -> Phases:
        ys: Dict[int, torch.Tensor] = {}

        def forward(i):
            ys[i] = call(xs[i].requires_grad_())[0]
        return {"F": forward, "backward": lambda i: torch.autograd.backward([ys.pop(i)], [gs[i]])}

    split_backward = SplitBackward(call)

    def passes_split() -> Phases:
        ys: Dict[int, torch.Tensor] = {}

        def forward(i):
            with split_backward.recording(i):
                ys[i] = call(xs[i].requires_grad_())[0]
        return {"F": forward, "B": lambda i: split_backward.input_pass(i, [ys.pop(i)], [gs[i]], [xs[i]]),
                "W": split_backward.weight_pass}

    return {"work 1f1b (whole backward)": lambda: work(False), "work zb (split backward)": lambda: work(True),
            "passes whole": passes_whole, "passes split": passes_split,
            "pack": lambda: {"pack+unpack": lambda i: unpack(pack([gs[i]], ["x2"], device))}}


def _counting(meter, call):
    def counted(i):
        with meter.counting():
            return call(i)
    return counted


def keras_arms(args) -> Dict[str, Callable[[], Phases]]:
    import keras
    import numpy as np
    import tensorflow as tf
    from bench_dist_pipeline_tf import build_model
    from dualframe.tensorflow.graph.capture import capture
    from dualframe.tensorflow.pipeline.compiled import GraphStageFunction
    from dualframe.tensorflow.pipeline.graph import process_stages
    from dualframe.tensorflow.pipeline.graph_work import TFGraphStageWork
    from dualframe.tensorflow.pipeline.message import pack, unpack
    from dualframe.pipeline.graph_walk import edge_values

    model = build_model(args.width, 3 * args.blocks)  # three stages of ``blocks``: the middle one is timed
    captured = capture(model)
    per = len(model.layers) // 3
    split, stages = process_stages(captured, balance=[per] * 3)
    loss = keras.losses.get("mse")
    function = GraphStageFunction(stages[1], split, 1, captured, loss, jit_compile=True)
    rng = np.random.RandomState(0)
    into, out = edge_values(split, 0, 1), edge_values(split, 1, 2)
    x_msgs = [pack([tf.constant(rng.randn(args.rows, args.width), tf.float32)], into) for _ in range(args.chunks)]
    gs = [[tf.constant(rng.randn(args.rows, args.width), tf.float32)] for _ in range(args.chunks)]
    g_msgs = [pack(g, out) for g in gs]

    def work(split_backward: bool) -> Phases:
        w = TFGraphStageWork(stages[1], split, 1, captured, loss, [], [1.0] * args.chunks, None, function,
                             split_backward=split_backward)
        phases: Phases = {"F": lambda i: w.forward(i, {0: x_msgs[i]}), "B": lambda i: w.backward(i, {2: g_msgs[i]})}
        if split_backward:
            phases["W"] = w.weight
        return phases

    return {"work 1f1b (whole backward)": lambda: work(False), "work zb (split backward)": lambda: work(True),
            "pack": lambda: {"pack+unpack": lambda i: unpack(pack(gs[i], out))}}


def main() -> None:
    args = ARGS.parse_args()
    bench_env.one_thread_per_process(tensorflow=args.framework == "keras")
    arms = (torch_arms if args.framework == "torch" else keras_arms)(args)
    seconds: Dict[str, Dict[str, List[float]]] = {name: {} for name in arms}
    for name, phases in arms.items():  # warm-up: allocator, autograd, traces
        timed(phases, args.chunks, {})
    for _ in range(args.rounds):
        for name, phases in arms.items():
            timed(phases, args.chunks, seconds[name])
    print(f"{args.framework}, one stage of {args.blocks} x ({args.width} wide, ReLU), {args.chunks} micro-batches of "
          f"{args.rows} rows, 1 thread; CPU ms per micro-batch, median of {args.rounds} interleaved rounds")
    for name, phases in seconds.items():
        medians = {phase: statistics.median(ms) for phase, ms in phases.items()}
        parts = ", ".join(f"{phase} {ms:.3f}" for phase, ms in medians.items())
        print(f"{name}: {parts}; sum {sum(medians.values()):.3f}")


if __name__ == "__main__":
    main()

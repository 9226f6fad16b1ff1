"""A torch chain's stage work before and after it ran as a graph: TorchStageWork of a base checkout against TorchGraphStageWork.

    git worktree add /tmp/chain-base 75c8e1f    # the last commit whose torch chain took its own walk and work
    .venv/bin/python scripts/bench_chain_as_graph.py --base /tmp/chain-base

One process, one thread, CPU seconds (``time.process_time``, so the figure holds while other jobs load the
box): the two stages of 12 x (Linear(512), ReLU), batch 2048, 8 micro-batches, in GPipe's order (F0..F7 on
stage 0, F0..F7 then B7..B0 on stage 1, B7..B0 on stage 0), messages handed over in memory. ``chain``:
the base's ``pipeline_work.TorchStageWork`` (tensors passed as they are); ``graph``: this checkout's
``graph_stage_work.TorchGraphStageWork`` over ``graph.chain.ChainPart`` (each message packed into one
``uint8`` tensor and unpacked). Interleaved rounds, the order flipped every round; prints the median of the
per-round ratios graph / chain. The transport is left out: ``bench_vs_unsplit.py`` run from both checkouts
measures the whole step.
"""
import argparse
import importlib.util
import pathlib
import statistics
import time

import bench_env

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--base", type=pathlib.Path, required=True, help="a checkout holding dualframe/torch/pipeline_work.py")
ARGS.add_argument("--rounds", type=int, default=15)
ARGS.add_argument("--chunks", type=int, default=8)


def arms(base_dir, chunks):
    import torch
    from torch import nn

    from dualframe.torch.pipeline.activation_meter import ActivationMeter
    from dualframe.torch.graph.chain import ChainPart, ChainStage
    from dualframe.torch.pipeline.graph_work import TorchGraphStageWork

    spec = importlib.util.spec_from_file_location("base_work", base_dir / "dualframe/torch/pipeline_work.py")
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    parts = [nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(512, 512), nn.ReLU())]) for _ in range(2)]
    xs, ys = torch.randn(2048, 512).chunk(chunks), list(torch.randn(2048, 512).chunk(chunks))
    weights, loss_fn, cpu = [1 / chunks] * chunks, nn.MSELoss(), torch.device("cpu")

    def chain():
        works = [base.TorchStageWork(p, j == 0, j == 1, loss_fn, ys, weights, base.ActivationMeter(p.parameters()))
                 for j, p in enumerate(parts)]
        sent = [works[0].forward(i, xs[i]) for i in range(chunks)]
        for i in range(chunks):
            works[1].forward(i, sent[i])
        for i in reversed(range(chunks)):
            works[0].backward(i, works[1].backward(i, None))

    def graph():
        c = ChainPart(2)
        works = [TorchGraphStageWork(ChainStage(p), c.split, j, c.unflatten, cpu, loss_fn, ys if j else [], weights,
                                     ActivationMeter(p.parameters())) for j, p in enumerate(parts)]
        sent = [works[0].forward(i, {-1: {c.input: xs[i]}})[1] for i in range(chunks)]
        for i in range(chunks):
            works[1].forward(i, {0: sent[i]})
        for i in reversed(range(chunks)):
            works[0].backward(i, {1: works[1].backward(i, {})[0]})
    return {"chain": chain, "graph": graph}


def cpu_seconds(step):
    start = time.process_time()
    step()
    return time.process_time() - start


def main():
    args = ARGS.parse_args()
    bench_env.one_thread_per_process(tensorflow=False)
    steps = arms(args.base.resolve(), args.chunks)
    times = {name: [] for name in steps}
    for name, step in steps.items():  # warm-up
        step()
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            times[name].append(cpu_seconds(steps[name]))
    ratios = [g / c for g, c in zip(times["graph"], times["chain"])]
    print(f"CPU s per step (median): chain {statistics.median(times['chain']):.3f}, "
          f"graph {statistics.median(times['graph']):.3f}; graph / chain median {statistics.median(ratios):.3f} "
          f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()

"""Where a 2-process pipeline step's time goes on each rank: compute, packing, waiting, the rest (ms per step).

    flock /tmp/dualframe-mp.lock mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none \\
        -x OMP_NUM_THREADS=1 -x TF_NUM_INTRAOP_THREADS=1 -x TF_NUM_INTEROP_THREADS=1 -x PATH \\
        .venv/bin/python scripts/bench_step_split.py --framework keras   # torch; --model encoder

The model and step of ``scripts/bench_vs_unsplit.py``'s chunks=8 arm (GPipe, one stage per rank, one thread
per process, the optimizer step included). Spans: ``compute``: the walk's actions less the Keras
messages' packing; ``pack``: ``graph_work.pack`` and ``unpack`` (torch sends its tensors unpacked);
``wait``: receives and the step's last sends' delivery (``StageLink.receive``, ``finish``), and the step
agreement, where a rank waits for the other to start; ``other``: the step less those (sends, the optimizer
step, Python between cells). Keras arms (``--arms``): ``fused``: as ``DistributedPipeline`` runs GPipe
(``schedule.fused_last_stage``); ``gpipe``: GPipe's own order (``B7`` first), for comparison. Arms take
turns in rounds; medians per rank.
"""
import argparse
import collections
import statistics
import time

import bench_env

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--framework", choices=("torch", "keras"), default="keras")
ARGS.add_argument("--model", choices=("dense", "encoder"), default="dense")
ARGS.add_argument("--arms", default="fused,gpipe", help="Keras: fused, gpipe (torch: one arm)")
ARGS.add_argument("--rounds", type=int, default=5)
ARGS.add_argument("--steps", type=int, default=3)
def gpipe_order(pipe):
    """Run ``pipe`` in GPipe's own order (what it ran before ``fused_last_stage``)."""
    from dualframe.pipeline.schedule import batched_weights
    pipe._batched_actions = batched_weights(pipe.role.layout.actions)[pipe.stage_index]
    pipe._fused_actions = None


def arms(args, timers):
    from dualframe.pipeline import link, stage
    timers.wrap(link.StageLink, "receive", "wait")
    timers.wrap(link.StageLink, "finish", "wait")
    timers.wrap(stage.PipelineStage, "agree", "wait")
    import bench_vs_unsplit
    if args.framework == "torch":
        hvd, made, pipes = bench_vs_unsplit.torch_arms(args.model)
        return hvd, {"torch": (made["chunks=8"], pipes[8])}
    from dualframe.tensorflow.pipeline import graph_work
    timers.wrap(graph_work, "pack", "pack")
    timers.wrap(graph_work, "unpack", "pack")
    found = {}
    for arm in args.arms.split(","):
        hvd, made, pipes = bench_vs_unsplit.keras_arms(args.model)
        made["chunks=8"]()  # builds the layers and compiles the stage's passes
        if arm == "gpipe":
            gpipe_order(pipes[8])
        found[arm] = made["chunks=8"], pipes[8]
    return hvd, found


def main() -> None:
    args = ARGS.parse_args()
    bench_env.one_thread_per_process(tensorflow=args.framework == "keras")
    import bench_common
    timers = bench_common.Timers()
    hvd, found = arms(args, timers)
    spent = timers.seconds
    rows = collections.defaultdict(list)
    for step, _ in found.values():
        step()  # warm-up: traces, shape headers
    for _ in range(args.rounds):
        for name, (step, pipe) in found.items():
            hvd.barrier()
            spent.clear()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            wall = time.perf_counter() - start
            busy = sum(record.busy for record in pipe.records.records[-args.steps:])
            spans = {"step": wall, "compute": busy - spent["pack"], "pack": spent["pack"], "wait": spent["wait"]}
            spans["other"] = wall - busy - spent["wait"]
            rows[name].append({k: v / args.steps * 1e3 for k, v in spans.items()})
    lines = [f"rank {hvd.rank()} {args.framework} {args.model} {name}: "
             + ", ".join(f"{k} {statistics.median(r[k] for r in kept):.1f}" for k in kept[0])
             for name, kept in rows.items()]
    for rank, part in enumerate(hvd.allgather_object(lines)):
        if hvd.rank() == 0:
            print(f"ms per step, median of {args.rounds} rounds of {args.steps} steps (rank {rank}):")
            print("\n".join(part))


if __name__ == "__main__":
    main()

"""Build time of a DistributedPipeline over a Hugging Face GPT-2 against its first and its median training step.

    mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none -x OMP_NUM_THREADS=1 -x PATH -x PYTHONPATH \\
        .venv/bin/python scripts/bench_hf_build.py

A 4-block GPT-2 (hidden 64, 4 heads, vocabulary 256) from a config, ``stages=2`` (cut at ``transformer.h.2``:
the blocks counted, by parameter bytes), GPipe with 4 micro-batches of 8 x 32 tokens each (batch 32). Each
rank times its imports, the pipeline's build (from the built model to a pipeline ready to step), the first
training step and the median of the next ``--steps`` steps, and splits the build into its parts by timing
the functions that make it (the torch.fx attempt, torch.export, the gradient check, the cut, the stage
modules, opening the stage's links); rank 0 prints every rank's line. The build is measured ``--builds`` times in turn (a fresh model copy each time;
the first build also pays torch.export's one-time warm-up in the process), each followed by its first step.
Last, ``--rounds`` interleaved rounds (A B C A B C, medians) of dualframe's capture alone and of torch.export
on the same call with the batch dimension left free (as the capture does: micro-batches differ in rows)
and fixed show what of the build is torch.export, and what the symbolic batch size costs within it.
"""
import time

_START = time.perf_counter()

import bench_env  # noqa: E402  (scripts/ is sys.path[0])

bench_env.one_thread_per_process(tensorflow=False)

import copy  # noqa: E402
import statistics  # noqa: E402
from typing import Callable, Dict, List, Tuple  # noqa: E402

_T0 = time.perf_counter()
import torch  # noqa: E402

_T1 = time.perf_counter()
import transformers  # noqa: E402

_T2 = time.perf_counter()
import dualframe.torch as hvd  # noqa: E402

_T3 = time.perf_counter()
import bench_common  # noqa: E402
from dualframe.observe.bench_rounds import interleaved  # noqa: E402
from dualframe.torch.split.pipeline import graph as distributed_graph  # noqa: E402
from dualframe.torch.split.pipeline import distributed as distributed_pipeline  # noqa: E402
from dualframe.torch.graph.capture import capture as graph  # noqa: E402

IMPORTS = {"torch": _T1 - _T0, "transformers": _T2 - _T1, "dualframe.torch": _T3 - _T2}

#: (module, attribute, label): the build's parts, timed where the build calls them.
PARTS = [
    (distributed_graph, "capture", "capture in all"),
    (graph.LeafTracer, "trace", "torch.fx attempt"),
    (graph, "_export", "torch.export"),
    (graph, "check_gradients", "gradient check"),
    (graph, "_captured", "graph from export"),
    (distributed_graph, "_param_bytes", "cost (parameter bytes)"),
    (distributed_graph, "cut_graph", "cut"),
    (distributed_graph, "check_crossing", "crossing check"),
    (distributed_graph.GraphPart, "module", "stage modules"),
    (distributed_pipeline, "find_stage_tied", "tied search"),
    (distributed_pipeline, "open_stage", "open stage (links)"),
]


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def batch(rows: int, length: int) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (rows, length), generator=g)
    target = torch.randint(0, 256, (rows, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, target


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, 256), target.reshape(-1))


def timed(call: Callable[[], object]) -> Tuple[object, float]:
    start = time.perf_counter()
    out = call()
    return out, time.perf_counter() - start


def build_and_step(model: torch.nn.Module, inputs, target, steps: int,
                   timers: "bench_common.Timers") -> Dict[str, object]:
    """One build, its first step and the median of ``steps`` more; the build's parts from ``timers``."""
    timers.seconds.clear()
    hvd.allreduce(torch.zeros(1), name="bench.sync")  # the ranks start the build together
    pipe, build = timed(lambda: hvd.DistributedPipeline(copy.deepcopy(model), chunks=4, loss_fn=loss_fn, stages=2,
                                                        sample=inputs))
    parts = dict(timers.seconds)
    assert pipe.graph is not None and pipe.graph.split.split_points == ("transformer.h.2",)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        pipe.train_step(inputs if pipe.is_first else None, target if pipe.is_last else None)
        optimizer.step()
    _, first = timed(step)
    median = statistics.median(timed(step)[1] for _ in range(steps))
    return {"build": build, "first": first, "median": median, "parts": parts}


def export_alone(model: torch.nn.Module, inputs: Dict[str, torch.Tensor], rounds: int) -> str:
    """dualframe's capture, torch.export with the batch dimension free and with it fixed, interleaved: medians."""
    free = {name: {0: torch.export.Dim.AUTO} for name in inputs}
    configs = {"capture": lambda: timed(lambda: graph.capture(model, sample=inputs))[1],
               "export, batch free": lambda: timed(lambda: torch.export.export(
                   model, (), inputs, dynamic_shapes=free, strict=False))[1],
               "export, batch fixed": lambda: timed(lambda: torch.export.export(model, (), inputs, strict=False))[1]}
    times = interleaved(configs, rounds)
    return (f"    alone, {rounds} rounds interleaved, median s: "
            + ", ".join(f"{name} {statistics.median(t):.2f}" for name, t in times.items()))


def report(rank: int, k: int, run: Dict[str, object]) -> str:
    build, first, median = float(run["build"]), float(run["first"]), float(run["median"])  # type: ignore[arg-type]
    parts = run["parts"]
    assert isinstance(parts, dict)
    split = ", ".join(f"{label} {parts.get(label, 0.0):.2f}" for _, _, label in PARTS if parts.get(label))
    return (f"rank {rank} build {k}: build {build:.2f} s, first step {first:.3f} s, median step {median:.4f} s; "
            f"build / first {build / first:.1f}, build / median {build / median:.0f}\n    parts (s): {split}")


def main() -> None:
    args = bench_common.parser(__doc__, builds=2, steps=20, rows=32, length=32, rounds=3).parse_args()
    bench_common.init_two_processes(hvd)
    timers = bench_common.Timers()
    for owner, name, label in PARTS:
        timers.wrap(owner, name, label)
    model = gpt2()
    inputs, target = batch(args.rows, args.length)
    runs = [build_and_step(model, inputs, target, args.steps, timers) for _ in range(args.builds)]
    lines: List[str] = [f"rank {hvd.rank()} imports (s): "
                        + ", ".join(f"{name} {seconds:.2f}" for name, seconds in IMPORTS.items())
                        + f"; process start to main {_T0 - _START + sum(IMPORTS.values()):.2f}"]
    lines += [report(hvd.rank(), k, run) for k, run in enumerate(runs)]
    lines.append(export_alone(model, inputs, args.rounds))
    gathered = hvd.allgather_object(lines)
    if hvd.rank() == 0:
        print(f"GPT-2 4 blocks, hidden 64, batch {args.rows} x {args.length} tokens, 4 micro-batches, "
              f"stages=2 (cut at transformer.h.2), torch {torch.__version__}, transformers {transformers.__version__}")
        for rank_lines in gathered:
            print("\n".join(rank_lines))


if __name__ == "__main__":
    main()

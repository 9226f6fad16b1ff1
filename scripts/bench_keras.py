"""What the Keras process-pipeline benchmarks share: seeded data, ZB-H1 against 1F1B in interleaved rounds."""
from typing import Any, Callable, List, Tuple

import numpy as np

import dualframe.tensorflow as hvd
from bench_common import interleaved_steps, per_step_line, zb_bubble_head
from dualframe.observe.bench_rounds import ratio_line


def random_xy(batch: int, width: int) -> Tuple[np.ndarray, np.ndarray]:
    """Inputs and targets, ``batch`` x ``width`` float32 each, from ``RandomState(0)``: the same on every rank."""
    rng = np.random.RandomState(0)
    x = rng.randn(batch, width).astype("float32")
    y = rng.randn(batch, width).astype("float32")
    return x, y


def zb_against_1f1b(ours: Callable[[int, str], Tuple[Any, Callable[..., Any]]], x: Any, y: Any, m: int, rounds: int,
                    steps: int) -> Tuple[str, List[str]]:
    """ZB-H1 against 1F1B at ``m`` micro-batches, interleaved rounds: (transport, report lines).

    The lines: throughput zb-h1 / 1f1b, the seconds per step, and per schedule the measured bubble beside
    its theory, the walk's and computing seconds per stage and the micro-batches each rank held at once.
    ``ours(m, schedule)`` builds one pipeline: (pipe, step).
    """
    pipes, configs = {}, {}
    for schedule in ("1f1b", "zb-h1"):
        pipes[schedule], configs[f"{schedule} m={m}"] = ours(m, schedule)
    for name, step in configs.items():  # warm-up: the eager first step, then the compiled passes' traces (XLA)
        step(x, y)
        step(x, y)
        pipes[name.split()[0]].records.records = []  # the bubbles below: timed steps only (the first left out)
    times = interleaved_steps(configs, (x, y), steps, rounds, hvd.barrier)
    report = [ratio_line(f"zb-h1 m={m} / 1f1b m={m}", times[f"1f1b m={m}"], times[f"zb-h1 m={m}"]),
              per_step_line(times, steps, "seconds per step (median over rounds)")]
    for schedule, pipe in pipes.items():
        busy, walls, held = zip(*hvd.allgather_object(
            (pipe.records.mean_busy(), pipe.records.mean_wall(), pipe.peak_live)))
        report.append(zb_bubble_head(schedule, m, busy, walls) + f"; walk {max(walls):.3f} s, computing per stage s: "
                      f"{' '.join(f'{b:.3f}' for b in busy)}; micro-batches held per rank: {list(held)}")
    return pipes["zb-h1"].transport, report

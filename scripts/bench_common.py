"""What the benchmark scripts share once their framework loads: command line, two processes, timed rounds, reports.

Imported after ``bench_env.one_thread_per_process()`` where a script calls it (it imports ``dualframe``).
"""
import argparse
import functools
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from dualframe.observe.bench_rounds import interleaved, seconds_line, timed_steps
from dualframe.pipeline.clock import gpipe_bubble, zb_h1_bubble
from dualframe.pipeline.walk import pipeline_bubble


def parser(doc: str, only_parts: bool = False, helps: Optional[Mapping[str, str]] = None,
           **defaults: Union[int, float]) -> argparse.ArgumentParser:
    """The scripts' parser: the docstring's first line, one ``--name`` per default (of the default's type).

    Args:
        doc: the script's ``__doc__``.
        only_parts: also ``--only-zb`` and ``--only-ratios`` (the process-pipeline benchmarks' parts 4 and 1).
        helps: help text by option name (as in ``defaults``).
        defaults: option name (``cell_ms`` for ``--cell-ms``) -> default, in the order they are listed.
    """
    helps = helps or {}
    parsed = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        parsed.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=helps.get(name))
    if only_parts:
        parsed.add_argument("--only-zb", action="store_true", help="run part 4 (zb-h1 against 1f1b) alone")
        parsed.add_argument("--only-ratios", action="store_true", help="run part 1 (throughput ratios) alone")
    return parsed


def two_stage_header(model: str, args: argparse.Namespace, stages: str = "2 stages") -> str:
    """``<model>, batch B, <stages>, 1 thread per process, R rounds of S steps``: the process pipelines' first line."""
    return f"{model}, batch {args.batch}, {stages}, 1 thread per process, {args.rounds} rounds of {args.steps} steps"


class Timers:
    """Seconds spent in each part, summed over its calls (an inner call's time counts in its caller too)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
        setattr(owner, name, timed)


def init_two_processes(hvd: Any) -> None:
    """``hvd.init()``, then refuse any number of processes but two (the benchmarks' two stages)."""
    hvd.init()
    if hvd.size() != 2:
        raise SystemExit(f"run with 2 processes (processes: {hvd.size()})")


def interleaved_steps(configs: Mapping[str, Callable[..., Any]], args: Sequence[Any], steps: int, rounds: int,
                      barrier: Callable[[], Any]) -> Dict[str, List[float]]:
    """Seconds per round of ``steps`` calls ``step(*args)`` of each configuration, the configurations taking turns."""
    return interleaved({name: functools.partial(timed_steps, step, args, steps, barrier)
                        for name, step in configs.items()}, rounds)


def pipeline_step(pipe: Any, optimizer: Any) -> Callable[[Any, Any], None]:
    """One training step of a torch process pipeline as a ``step(x, y)``: zero the gradients, ``train_step``, update."""
    def step(x: Any, y: Any) -> None:
        optimizer.zero_grad()
        pipe.train_step(x, y)
        optimizer.step()
    return step


def stage_seconds(pipe: Any, allgather: Callable[[Any], List[Any]]) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Every rank's mean busy and mean wall seconds per step of its stage, as (busy, walls), rank by rank."""
    busy, walls = zip(*allgather((pipe.records.mean_busy(), pipe.records.mean_wall())))
    return busy, walls


def bubbles_by_chunks(ours: Callable[[int], Tuple[Any, Callable[..., Any]]], x: Any, y: Any, steps: int,
                      allgather: Callable[[Any], List[Any]]) -> Iterator[Tuple[int, Sequence[float], Sequence[float]]]:
    """(m, busy, walls) for m = 1, 2, 4, 8, 16 micro-batches, each pipeline ``ours(m)`` run ``steps + 1`` steps."""
    for m in (1, 2, 4, 8, 16):
        pipe, step = ours(m)
        for _ in range(steps + 1):
            step(x, y)
        yield (m, *stage_seconds(pipe, allgather))


def zb_bubble_head(schedule: str, m: int, busy: Sequence[float], walls: Sequence[float]) -> str:
    """``bubble <schedule> m=<m>: measured X%, theory Y%``; theory: 1f1b (n-1)/(m+n-1), zb-h1 (n-1)/(3m+n-1)."""
    theory = {"1f1b": gpipe_bubble, "zb-h1": zb_h1_bubble}[schedule](2, m)
    return f"bubble {schedule} m={m}: measured {pipeline_bubble(busy, walls):.1%}, theory {theory:.1%}"


def per_step_line(times: Mapping[str, Sequence[float]], steps: int, label: str) -> str:
    """``seconds_line`` of each round's seconds / ``steps``, ``label`` where it says ``step seconds (median)``."""
    per_step = {name: [t / steps for t in ts] for name, ts in times.items()}
    return seconds_line(per_step).replace("step seconds (median)", label)


def print_report(rank: int, header: str, lines: Sequence[str]) -> None:
    """On rank 0 only: the header, then one report line a line, flushed (launchers interleave ranks' output)."""
    if rank == 0:
        print(header + "\n" + "\n".join(lines), flush=True)

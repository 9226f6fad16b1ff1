"""What the benchmark scripts share before and around their frameworks: one thread per process, the repo on sys.path, the command line, two processes.

Only the standard library at the top: ``one_thread_per_process`` must run before torch or TensorFlow
is imported (they read the thread variables once, when they load), and before ``dualframe`` is, so
that this checkout's copy is the one imported rather than the venv's editable install.

    import bench_env  # scripts/ is sys.path[0] when a script runs as ``python scripts/X.py``

    bench_env.one_thread_per_process()

    import keras  # noqa: E402
"""
import argparse
import functools
import os
import pathlib
import sys
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

ROOT = pathlib.Path(__file__).resolve().parent.parent
THREAD_VARIABLES = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def one_thread_per_process(tensorflow: bool = True) -> None:
    """One thread per process unless the environment says otherwise, TensorFlow's C++ logs quiet, the repo first on sys.path.

    Args:
        tensorflow: also TensorFlow's two thread pools and its log level; False sets OMP_NUM_THREADS only.
    """
    for name in THREAD_VARIABLES if tensorflow else THREAD_VARIABLES[:1]:
        os.environ.setdefault(name, "1")
    if tensorflow:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    repo_on_path()


def repo_on_path() -> None:
    """This checkout first on sys.path: ``import dualframe`` finds it, not the venv's editable install of another."""
    sys.path.insert(0, str(ROOT))


def parser(doc: str, only_parts: bool = False, helps: Optional[Mapping[str, str]] = None,
           **defaults: Union[int, float]) -> argparse.ArgumentParser:
    """The scripts' parser: described by the docstring's first line, one ``--name`` per default (its type the default's).

    Args:
        doc: the script's ``__doc__``.
        only_parts: also ``--only-zb`` and ``--only-ratios`` (the process-pipeline benchmarks' parts 4 and 1).
        helps: help text by option name (as in ``defaults``).
        defaults: option name (``cell_ms`` for ``--cell-ms``) -> default, in the order they are listed.
    """
    helps = helps or {}
    parsed = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        parsed.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                            **({"help": helps[name]} if name in helps else {}))
    if only_parts:
        parsed.add_argument("--only-zb", action="store_true", help="run part 4 (zb-h1 against 1f1b) alone")
        parsed.add_argument("--only-ratios", action="store_true", help="run part 1 (throughput ratios) alone")
    return parsed


def init_two_processes(hvd: Any) -> None:
    """``hvd.init()``, then refuse any number of processes but two (the benchmarks' two stages)."""
    hvd.init()
    if hvd.size() != 2:
        raise SystemExit(f"run with 2 processes (processes: {hvd.size()})")


def interleaved_steps(configs: Mapping[str, Callable[..., Any]], args: Sequence[Any], steps: int, rounds: int,
                      barrier: Callable[[], Any]) -> Dict[str, List[float]]:
    """Seconds per round of ``steps`` calls ``step(*args)`` of each configuration, the configurations taking turns."""
    # imported here, not at the top: one_thread_per_process puts this checkout on sys.path first
    from dualframe.observe.bench_rounds import interleaved, timed_steps

    return interleaved({name: functools.partial(timed_steps, step, args, steps, barrier)
                        for name, step in configs.items()}, rounds)


def stage_seconds(pipe: Any, allgather: Callable[[Any], List[Any]]) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Every rank's mean busy and mean wall seconds per step of its stage, as (busy, walls), rank by rank."""
    busy, walls = zip(*allgather((pipe.records.mean_busy(), pipe.records.mean_wall())))
    return busy, walls


def bubbles_by_chunks(ours: Callable[[int], Tuple[Any, Callable[..., Any]]], x: Any, y: Any, steps: int,
                      allgather: Callable[[Any], List[Any]]) -> Iterator[Tuple[int, Tuple[float, ...], Tuple[float, ...]]]:
    """(m, busy, walls) for m = 1, 2, 4, 8, 16 micro-batches, each pipeline ``ours(m)`` run ``steps + 1`` steps first."""
    for m in (1, 2, 4, 8, 16):
        pipe, step = ours(m)
        for _ in range(steps + 1):
            step(x, y)
        yield (m, *stage_seconds(pipe, allgather))


def zb_bubble_head(schedule: str, m: int, busy: Sequence[float], walls: Sequence[float]) -> str:
    """``bubble <schedule> m=<m>: measured X%, theory Y%``: 1f1b's theory (n-1)/(m+n-1), zb-h1's (n-1)/(3m+n-1), n = 2."""
    from dualframe.pipeline.clock import gpipe_bubble, zb_h1_bubble
    from dualframe.pipeline.walk import pipeline_bubble

    theory = {"1f1b": gpipe_bubble, "zb-h1": zb_h1_bubble}[schedule](2, m)
    return f"bubble {schedule} m={m}: measured {pipeline_bubble(busy, walls):.1%}, theory {theory:.1%}"


def per_step_line(times: Mapping[str, Sequence[float]], steps: int, label: str) -> str:
    """``seconds_line`` of each round's seconds divided by its ``steps``, its ``step seconds (median)`` said as ``label``."""
    from dualframe.observe.bench_rounds import seconds_line

    per_step = {name: [t / steps for t in ts] for name, ts in times.items()}
    return seconds_line(per_step).replace("step seconds (median)", label)


def print_report(rank: int, header: str, lines: Sequence[str]) -> None:
    """On rank 0 only: the header, then one report line a line, flushed (launchers interleave ranks' output)."""
    if rank == 0:
        print(header + "\n" + "\n".join(lines), flush=True)

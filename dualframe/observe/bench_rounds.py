"""Interleaved benchmark rounds and their report lines (median ratios, bubble vs theory), shared by both frameworks' benchmarks."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Sequence

from dualframe.errors import StrategyError
from dualframe.pipeline.clock import gpipe_bubble


def timed_steps(step: Callable[..., Any], args: Sequence[Any], steps: int, barrier: Callable[[], Any]) -> float:
    """Seconds for ``steps`` calls of ``step(*args)`` between two barriers, so every rank times the same span.

    Example:
        >>> timed_steps(lambda x: x + 1, (1,), 3, barrier=lambda: None) >= 0.0
        True
    """
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(*args)
    barrier()
    return time.perf_counter() - start


def interleaved(configs: Mapping[str, Callable[[], float]], rounds: int) -> Dict[str, List[float]]:
    """Run every configuration once per round, in order (A B C A B C ...): seconds per configuration per round.

    Interleaving spreads a shared machine's load over all configurations alike, so the per-round
    ratios stay comparable while the absolute times drift.

    Args:
        configs: name -> a callable timing one block of work, returning its seconds.
        rounds: how many rounds (>= 1).

    Example:
        >>> times = interleaved({"a": lambda: 2.0, "b": lambda: 1.0}, rounds=2)
        >>> times
        {'a': [2.0, 2.0], 'b': [1.0, 1.0]}

    Raises:
        StrategyError: rounds below one or no configuration.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise StrategyError(f"rounds must be an int >= 1 (rounds: {rounds!r})")
    if not configs:
        raise StrategyError("interleaved needs at least one configuration (configs: {})")
    times: Dict[str, List[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, timed in configs.items():
            times[name].append(float(timed()))
    return times


def ratio_line(label: str, baseline: Sequence[float], other: Sequence[float]) -> str:
    """``throughput <label>: median R (rounds: ...)`` where each round's R = baseline seconds / other seconds.

    Example:
        >>> ratio_line("chunks=8 / chunks=1", [2.0, 3.0, 2.0], [1.0, 2.0, 1.0])
        'throughput chunks=8 / chunks=1: median 2.00 (rounds: 2.00 1.50 2.00)'
    """
    if len(baseline) != len(other) or not baseline:
        raise StrategyError(f"ratio_line needs as many rounds on both sides, at least one "
                            f"(baseline: {len(baseline)}, other: {len(other)})")
    ratios = [a / b for a, b in zip(baseline, other)]
    return (f"throughput {label}: median {statistics.median(ratios):.2f} "
            f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})")


def seconds_line(times: Mapping[str, Sequence[float]]) -> str:
    """``step seconds (median): a 1.000, b 0.500``, one median per configuration.

    Example:
        >>> seconds_line({"a": [1.0, 3.0, 2.0], "b": [0.5]})
        'step seconds (median): a 2.000, b 0.500'
    """
    return "step seconds (median): " + ", ".join(f"{name} {statistics.median(t):.3f}" for name, t in times.items())


def bubble_line(chunks: int, measured: float, stages: int = 2) -> str:
    """The measured bubble beside GPipe's (n-1)/(m+n-1) for ``chunks`` micro-batches and ``stages`` stages.

    Example:
        >>> bubble_line(4, 0.25)
        'bubble m= 4: measured 25.0%, theory (n-1)/(m+n-1) 20.0%'
    """
    return f"bubble m={chunks:2d}: measured {measured:.1%}, theory (n-1)/(m+n-1) {gpipe_bubble(stages, chunks):.1%}"

"""Interleaved benchmark rounds: order of the calls, report lines, refusals."""
import pytest

from dualframe.observe.bench_rounds import bubble_line, interleaved, ratio_line, seconds_line
from dualframe.errors import StrategyError


def test_rounds_interleave_the_configurations_in_order():
    calls = []

    def timed(name, seconds):
        return lambda: calls.append(name) or seconds

    times = interleaved({"a": timed("a", 3.0), "b": timed("b", 1.5), "c": timed("c", 1.0)}, rounds=3)
    assert calls == ["a", "b", "c"] * 3
    assert times == {"a": [3.0] * 3, "b": [1.5] * 3, "c": [1.0] * 3}


def test_ratio_is_the_median_of_per_round_ratios():
    # Round ratios 2.0, 1.0, 4.0: median 2.0 (a ratio of medians would be 3/1 = 3.0).
    assert ratio_line("x / y", [2.0, 3.0, 4.0], [1.0, 3.0, 1.0]) == "throughput x / y: median 2.00 (rounds: 2.00 1.00 4.00)"
    assert seconds_line({"y": [1.0, 3.0, 1.0]}) == "step seconds (median): y 1.000"


def test_bubble_line_beside_the_formula():
    assert bubble_line(1, 0.5) == "bubble m= 1: measured 50.0%, theory (n-1)/(m+n-1) 50.0%"
    assert bubble_line(16, 0.1, stages=4) == "bubble m=16: measured 10.0%, theory (n-1)/(m+n-1) 15.8%"


def test_bad_arguments_are_refused():
    with pytest.raises(StrategyError, match=r"rounds must be an int >= 1 \(rounds: 0\)"):
        interleaved({"a": lambda: 1.0}, rounds=0)
    with pytest.raises(StrategyError, match=r"at least one configuration"):
        interleaved({}, rounds=1)
    with pytest.raises(StrategyError, match=r"\(baseline: 2, other: 1\)"):
        ratio_line("x", [1.0, 2.0], [1.0])

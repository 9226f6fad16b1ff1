"""Partitioning: ``balance`` (layers per group) validated and turned into ranges of layer indices."""
from __future__ import annotations

from typing import List, Optional, Sequence

from dualframe.errors import BalanceError


def validate_balance(balance: Sequence[int], num_layers: Optional[int] = None) -> List[int]:
    """Check a balance and return it as a list of ints.

    Args:
        balance: number of consecutive layers in each group, e.g. ``[2, 3]``.
        num_layers: when given, the balance must sum to it.

    Returns:
        The balance as a new list.

    Raises:
        BalanceError: empty, a non-integer, a group below one, or the wrong sum.
    """
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise BalanceError(f"balance must be a list of layer counts, e.g. [2, 2] (balance: {balance!r})")
    if len(balance) == 0:
        raise BalanceError("balance must name at least one group (balance: [])")
    for j, layers in enumerate(balance):
        if isinstance(layers, bool) or not isinstance(layers, int):
            raise BalanceError(f"balance entries must be ints (balance[{j}]: {layers!r})")
        if layers < 1:
            raise BalanceError(
                f"every group needs at least one layer (balance: {list(balance)}, balance[{j}] = {layers})"
            )
    total = sum(balance)
    if num_layers is not None and total != num_layers:
        terms = " + ".join(str(b) for b in balance)
        raise BalanceError(
            f"balance must sum to the number of layers (balance: {list(balance)} = {terms} = {total}, "
            f"layers: {num_layers})"
        )
    return list(balance)


def partition_ranges(balance: Sequence[int], num_layers: Optional[int] = None) -> List[range]:
    """Turn a balance into the range of layer indices each group holds.

    Example:
        >>> partition_ranges([2, 3])
        [range(0, 2), range(2, 5)]
    """
    start = 0
    ranges = []
    for layers in validate_balance(balance, num_layers):
        ranges.append(range(start, start + layers))
        start += layers
    return ranges


def balance_by_cost(costs: Sequence[float], partitions: int) -> List[int]:
    """Split layers with the given costs into contiguous groups minimising the largest group's cost.

    The cost is whatever should be even across devices: parameter bytes, or measured seconds.

    Args:
        costs: one non-negative cost per layer, in layer order.
        partitions: how many groups to make; at most ``len(costs)``.

    Returns:
        The balance (layers per group).

    Raises:
        BalanceError: ``partitions`` below one or above the number of layers, or a negative cost.
    """
    n = partitions
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BalanceError(f"partitions must be an int >= 1 (partitions: {partitions!r})")
    if n > len(costs):
        raise BalanceError(
            f"cannot make more groups than there are layers (partitions: {n}, layers: {len(costs)})"
        )
    for index, cost in enumerate(costs):
        if not 0 <= cost < float("inf"):  # also refuses NaN, which would make any split look optimal
            raise BalanceError(f"layer costs must be finite and >= 0 (costs[{index}] = {cost})")
    # Binary search on the largest group cost, greedy packing; exact for the min-max objective.
    low, high = max(costs), float(sum(costs))
    for _ in range(100):
        if high - low <= 1e-12 * max(1.0, high):
            break
        middle = (low + high) / 2
        if _groups_needed(costs, middle) <= n:
            high = middle
        else:
            low = middle
    return _pack(costs, high, n)


def _groups_needed(costs: Sequence[float], limit: float) -> int:
    groups, current = 1, 0.0
    for cost in costs:
        if current + cost > limit and current > 0:
            groups += 1
            current = 0.0
        current += cost
    return groups


def _pack(costs: Sequence[float], limit: float, n: int) -> List[int]:
    """Greedy packing under ``limit`` that still leaves at least one layer for each later group."""
    balance: List[int] = []
    current, count = 0.0, 0
    for index, cost in enumerate(costs):
        remaining_layers = len(costs) - index
        remaining_groups = n - len(balance)
        must_close = count > 0 and remaining_layers < remaining_groups
        if count > 0 and (current + cost > limit * (1 + 1e-9) or must_close) and remaining_groups > 1:
            balance.append(count)
            current, count = 0.0, 0
        current += cost
        count += 1
    balance.append(count)
    return balance

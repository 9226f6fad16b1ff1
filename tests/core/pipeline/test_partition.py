"""Balances, partitions and micro-batch sizes."""
import pytest

from dualframe import BalanceError, ChunksError, balance_by_cost, micro_batch_offsets, micro_batch_sizes, partition_ranges


def test_ranges_follow_balance():
    assert partition_ranges([2, 3, 1]) == [range(0, 2), range(2, 5), range(5, 6)]


@pytest.mark.parametrize("balance, layers, message", [
    ([2, 2], 5, r"balance must sum to the number of layers \(balance: \[2, 2\] = 2 \+ 2 = 4, layers: 5\)"),
    ([2, 0], None, r"at least one layer .*balance\[1\] = 0"),
    ([2, -1], None, r"balance\[1\] = -1"),
    ([], None, r"at least one group"),
    ([2.0], None, r"must be ints"),
    ("22", None, r"must be a list"),
])
def test_bad_balance_is_refused(balance, layers, message):
    with pytest.raises(BalanceError, match=message):
        partition_ranges(balance, layers)


def test_balance_by_cost_minimises_the_largest_group():
    assert balance_by_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_by_cost([4, 1, 1, 1, 1], 2) == [1, 4]
    assert balance_by_cost([1, 1, 1, 1, 8], 3) == [3, 1, 1]
    assert balance_by_cost([0, 0, 0], 3) == [1, 1, 1]


def test_balance_by_cost_bad_input():
    with pytest.raises(BalanceError, match=r"more groups than there are layers \(partitions: 4, layers: 3\)"):
        balance_by_cost([1, 1, 1], 4)
    with pytest.raises(BalanceError, match=r"costs\[1\] = -1"):
        balance_by_cost([1, -1], 1)


def test_micro_batch_sizes_uneven():
    assert micro_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert micro_batch_sizes(8, 8) == [1] * 8
    assert micro_batch_offsets(5, 2) == [range(0, 3), range(3, 5)]


def test_batch_smaller_than_chunks_says_what_to_do():
    with pytest.raises(ChunksError, match=r"batch: 3, chunks: 4\); use chunks <= 3 or a larger batch"):
        micro_batch_sizes(3, 4)
    with pytest.raises(ChunksError, match=r"chunks must be an int >= 1 \(chunks: 0\)"):
        micro_batch_sizes(3, 0)

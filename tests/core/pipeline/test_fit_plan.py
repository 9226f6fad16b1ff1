"""What a process pipeline's fit checks before its first step: batch rows, replica shares, validation split, ranks alike."""
import pytest

from dualframe.errors import ChunksError, DataError
from dualframe.pipeline.fit_plan import batch_rows, check_batches, check_same, replica_rows, validation_split_rows


def test_batches_cut_as_keras_cuts_them():
    assert batch_rows(600, 64) == [64] * 9 + [24]
    assert batch_rows(64, 16, steps=3) == [16, 16, 16]
    with pytest.raises(DataError, match="batch_size must be at least 1"):
        batch_rows(10, 0)


def test_each_replica_takes_an_equal_share_of_at_least_chunks_rows():
    assert replica_rows(24, 2, 4) == 12
    with pytest.raises(DataError, match="does not split evenly among 2 pipeline replicas"):
        replica_rows(25, 2, 4)
    with pytest.raises(ChunksError, match="batch 9 of 6 rows gives each of 2 replica.s. 3 rows, fewer than chunks=4"):
        check_batches(batch_rows(582, 64), 2, 4)  # the last batch: 6 rows


def test_validation_split_leaves_rows_on_both_sides():
    assert validation_split_rows(64, 0.25) == (48, 16)
    with pytest.raises(DataError, match="leaves 0 for training"):
        validation_split_rows(64, 0.99)
    with pytest.raises(DataError, match="between 0 and 1"):
        validation_split_rows(64, 1.5)


def test_the_ranks_must_describe_the_same_data():
    check_same([{"rows": [8, 8]}] * 3, "fit")
    with pytest.raises(DataError, match="batches is 4 on rank 0 and 3 on rank 2"):
        check_same([{"batches": 4}, {"batches": 4}, {"batches": 3}], "fit")

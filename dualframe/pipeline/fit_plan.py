"""What a process pipeline's ``fit`` checks before its first step: batch rows per replica, the validation split, the ranks' agreement.

Framework-neutral rules the adapters' ``fit``/``evaluate``/``predict`` apply on every rank before any
step, so a bad input ends every rank with the same ``DataError`` instead of leaving one waiting for
another: each global batch splits evenly among the replicas and each replica's share holds at least
``chunks`` rows; a ``validation_split`` leaves rows on both sides; every rank describes the same data.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dualframe.errors import ChunksError, DataError


def batch_rows(samples: int, batch_size: int, steps: Optional[int] = None) -> List[int]:
    """Rows of each batch of an epoch over ``samples`` rows in order (the last one may be smaller).

    Example:
        >>> batch_rows(10, 4)
        [4, 4, 2]
        >>> batch_rows(10, 4, steps=2)
        [4, 4]
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1 (batch_size: {batch_size})")
    rows = [min(batch_size, samples - start) for start in range(0, samples, batch_size)]
    return rows[:steps] if steps else rows


def replica_rows(rows: int, replicas: int, chunks: int, what: str = "a batch") -> int:
    """Rows of each replica's share of a global batch of ``rows`` rows.

    Example:
        >>> replica_rows(16, 2, 4)
        8

    Raises:
        DataError: the rows do not split evenly among the replicas.
        ChunksError: a replica's share holds fewer rows than ``chunks``.
    """
    if rows % replicas:
        raise DataError(f"{what} of {rows} rows does not split evenly among {replicas} pipeline replicas; pick a "
                        f"batch_size (and a number of samples) that {replicas} divides, or drop the last rows")
    share = rows // replicas
    if share < chunks:
        raise ChunksError(f"{what} of {rows} rows gives each of {replicas} replica(s) {share} rows, fewer than "
                          f"chunks={chunks} micro-batches; use a batch_size of at least {chunks * replicas} "
                          f"(and drop a smaller last batch)")
    return share


def check_batches(rows: Sequence[int], replicas: int, chunks: int, what: str = "batch") -> None:
    """Check every batch of an epoch before the first step (``replica_rows`` on each).

    Example:
        >>> check_batches([8, 8, 4], replicas=2, chunks=2)
        >>> check_batches([8, 8, 2], replicas=2, chunks=2)
        Traceback (most recent call last):
        ...
        dualframe.errors.ChunksError: batch 2 of 2 rows gives each of 2 replica(s) 1 rows, ...
    """
    for k, count in enumerate(rows):
        replica_rows(count, replicas, chunks, f"{what} {k}")


def validation_split_rows(samples: int, split: float) -> Tuple[int, int]:
    """(training rows, validation rows) of Keras's ``validation_split``: the last ``split`` share validates.

    Example:
        >>> validation_split_rows(100, 0.2)
        (80, 20)

    Raises:
        DataError: ``split`` outside (0, 1), or a side left without rows.
    """
    if not 0.0 < split < 1.0:
        raise DataError(f"validation_split must be between 0 and 1 (validation_split: {split})")
    train = int(math.floor(samples * (1.0 - split)))
    if train == 0 or train == samples:
        raise DataError(f"validation_split={split} of {samples} samples leaves {train} for training and "
                        f"{samples - train} for validation; both need rows")
    return train, samples - train


def check_same(descriptions: Sequence[Dict[str, Any]], what: str) -> None:
    """Every rank described the same data and arguments (the ranks' descriptions, in rank order).

    Example:
        >>> check_same([{"batches": 3}, {"batches": 3}], "fit")
        >>> check_same([{"batches": 3}, {"batches": 4}], "fit")
        Traceback (most recent call last):
        ...
        dualframe.errors.DataError: fit: every rank must pass the same data and arguments, ...
    """
    first = descriptions[0]
    for rank, mine in enumerate(descriptions):
        for key in sorted(set(first) | set(mine)):
            if first.get(key) != mine.get(key):
                raise DataError(f"{what}: every rank must pass the same data and arguments, but {key} is "
                                f"{first.get(key)!r} on rank 0 and {mine.get(key)!r} on rank {rank}")

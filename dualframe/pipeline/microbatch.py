"""Micro-batch sizing: how a mini-batch of ``batch`` rows is cut into ``chunks`` micro-batches."""
from __future__ import annotations

from typing import FrozenSet, List

from dualframe.errors import ChunksError


def validate_chunks(chunks: int) -> int:
    """Return ``chunks`` if it is an int >= 1, else raise ChunksError."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ChunksError(f"chunks must be an int >= 1 (chunks: {chunks!r})")
    return chunks


def micro_batch_sizes(batch: int, chunks: int) -> List[int]:
    """Sizes of the micro-batches: ``chunks`` pieces differing by at most one row, larger first.

    Example:
        >>> micro_batch_sizes(10, 4)
        [3, 3, 2, 2]

    Raises:
        ChunksError: ``chunks`` below one, or a batch smaller than ``chunks``.
    """
    validate_chunks(chunks)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ChunksError(f"batch size must be an int >= 0 (batch: {batch!r})")
    if batch < chunks:
        raise ChunksError(
            f"the batch is smaller than chunks (batch: {batch}, chunks: {chunks}); "
            f"use chunks <= {max(batch, 1)} or a larger batch"
        )
    base, extra = divmod(batch, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def micro_batch_offsets(batch: int, chunks: int) -> List[range]:
    """Row ranges of the micro-batches, in order (see ``micro_batch_sizes``)."""
    start = 0
    ranges = []
    for size in micro_batch_sizes(batch, chunks):
        ranges.append(range(start, start + size))
        start += size
    return ranges


def recomputed(checkpoint: str, chunks: int) -> FrozenSet[int]:
    """The micro-batches that keep only their stage's input and recompute its forward in backward.

    ``"always"``: every micro-batch; ``"except_last"``: all but the last (under GPipe its backward comes
    first, so recomputing it saves no memory); ``"never"``: none. ``checkpoint`` is a checked mode
    (``dualframe.strategy.checkpoint_mode``).

    Example:
        >>> sorted(recomputed("except_last", 4)), sorted(recomputed("never", 4))
        ([0, 1, 2], [])
    """
    stop = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
    return frozenset(range(stop))

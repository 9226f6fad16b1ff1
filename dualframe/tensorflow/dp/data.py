"""tf.data helpers: give each rank its own equal share of a dataset."""
from __future__ import annotations

import tensorflow as tf

from dualframe.tensorflow.collectives import check_initialized, hvd


def shard(dataset: tf.data.Dataset, drop_remainder: bool = True) -> tf.data.Dataset:
    """This rank's shard of ``dataset``: every ``size()``-th element, starting at ``rank()``.

    With ``drop_remainder`` and a known length, the last ``len % size`` elements are dropped first,
    so every rank gets the same number of elements: a rank with one batch more would wait forever
    in an allreduce the others never join. Shard before ``shuffle``/``batch``.

    Example:
        >>> ds = hvd.shard(tf.data.Dataset.range(10))    # doctest: +SKIP
        >>> list(ds.as_numpy_iterator())                 # rank 1 of 2: doctest: +SKIP
        [1, 3, 5, 7, 9]
    """
    check_initialized("shard")
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"shard needs a tf.data.Dataset (got {type(dataset).__name__})")
    size, rank = hvd.size(), hvd.rank()
    length = int(dataset.cardinality())
    if drop_remainder and length > 0:
        dataset = dataset.take(length - length % size)
    return dataset.shard(size, rank)

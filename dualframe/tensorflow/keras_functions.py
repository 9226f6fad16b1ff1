"""Horovod's Keras collectives (``horovod.tensorflow.keras.allreduce`` ...): a value in, its reduced value out."""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from dualframe.tensorflow import functions
from dualframe.tensorflow.collectives import check_initialized, hvd
from dualframe.tensorflow.dp.compression import Compression
from dualframe.tensorflow.reliability.failure import eager_guard


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: Any = None, compression: Any = Compression.none) -> Any:
    """Reduce a tensor-compatible ``value`` over all ranks (default: the average), Horovod's Keras signature.

    Example:
        >>> hvd.allreduce(np.float32(hvd.rank()), name="mean_rank")  # doctest: +SKIP
    """
    return functions.allreduce(value, average=average, compression=compression, op=op,
                               prescale_factor=prescale_factor, postscale_factor=postscale_factor, name=name)


def allgather(value: Any, name: Optional[str] = None) -> Any:
    """Every rank's ``value`` concatenated along the first axis, Horovod's Keras signature."""
    return functions.allgather(value, name=name)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> Any:
    """``root_rank``'s ``value`` on every rank, Horovod's Keras signature."""
    return functions.broadcast(value, root_rank, name=name)


def reducescatter(value: Any, name: Optional[str] = None, op: Any = hvd.Average) -> Any:
    """Reduce ``value`` over all ranks and give each rank its slice of the first axis (Horovod's Keras signature)."""
    check_initialized("reducescatter")
    with eager_guard(f"reducescatter {name or ''}".strip()):
        return hvd.reducescatter(tf.convert_to_tensor(value), op=op, name=name)

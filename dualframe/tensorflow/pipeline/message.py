"""Tensors to and from a pipeline message's bytes in TensorFlow (the layout of ``dualframe.pipeline.message``).

Each message holds what one edge carries: an int64 header, then each tensor's bytes (Keras sends tensors
only, so no structure tail). An edge between two stages of one rank (ZB-V's turn) carries the tensors
themselves (``handed``).
"""
from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np
import tensorflow as tf

from dualframe.errors import StrategyError
from dualframe.pipeline import message
from dualframe.tensorflow.pipeline.link import DTYPES, tf_dtype_code


def pack(tensors: Sequence[Any], names: Sequence[str]) -> np.ndarray:
    """The tensors as one flat uint8 message (``dualframe.pipeline.message``'s layout), written in one copy.

    Each tensor's bytes go straight from its host memory into the message (the transports send a host
    array as it is), once: no joined copy, no tensor made of it.

    Example:
        >>> ids = tf.constant([2 ** 40 + 1], tf.int64)
        >>> [int(t[0]) for t in unpack(pack([ids, tf.constant([True])], ["ids", "mask"]))]
        [1099511627777, 1]

    Raises:
        StrategyError: a value that is not a tensor, or one of more than ``MAX_DIMS`` dimensions: cut elsewhere.
    """
    for name, t in zip(names, tensors):
        if not tf.is_tensor(t):
            raise StrategyError(f"value {name!r} crosses between process stages but is a {type(t).__name__}, not a "
                                "tensor; choose a cut where only tensors cross")
    head = message.header([(name, tf_dtype_code(t.dtype), tuple(t.shape)) for name, t in zip(names, tensors)])
    arrays = [np.asarray(t).reshape(-1).view(np.uint8) for t in tensors]  # views of the tensors' memory
    buffer = np.empty(len(head) + sum(a.size + message.padding(a.size) for a in arrays), np.uint8)
    buffer[:len(head)] = np.frombuffer(head, np.uint8)
    offset = len(head)
    for data in arrays:
        end = offset + data.size
        buffer[offset:end] = data
        buffer[end:end + message.padding(data.size)] = 0
        offset = end + message.padding(data.size)
    return buffer


def handed(tensors: Sequence[Any], names: Sequence[str]) -> List[tf.Tensor]:
    """The tensors for a stage on this rank, in place of a message: themselves (immutable), refused as ``pack`` does.

    Example:
        >>> h = tf.ones(2)
        >>> handed([h], ["h"])[0] is h
        True
    """
    if not all(tf.is_tensor(t) for t in tensors):
        pack(tensors, names)  # refuses the first value that is not a tensor, naming it, before any copy
    return list(tensors)


def unpack(raw: Any) -> List[tf.Tensor]:
    """The tensors of a ``pack`` message (same dtypes and shapes), each made from its bytes in one copy.

    A received message is a host array of its own (``link.TFWire.empty``), so its parts are read in place.
    """
    data = raw.numpy() if tf.is_tensor(raw) else np.asarray(raw, np.uint8)
    layout = message.read_layout(lambda n: data[:8 * n].view(np.int64).tolist())
    return [tf.constant(data[p.offset:p.offset + p.size].view(DTYPES[p.code].as_numpy_dtype).reshape(p.shape))
            for p in layout.parts]

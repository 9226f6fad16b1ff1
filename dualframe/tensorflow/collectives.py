"""TensorFlow collectives over horovod.tensorflow, implementing the core's Collectives protocol."""
from __future__ import annotations

from typing import ContextManager, List, Sequence

import numpy as np
import tensorflow as tf

from dualframe._deps import require
from dualframe.collectives import HorovodCollectives

hvd = require("horovod.tensorflow", "Horovod for TensorFlow (horovod.tensorflow)")


class TFCollectives(HorovodCollectives[tf.Tensor]):
    """Horovod collectives on TensorFlow tensors (the core's Collectives protocol, written once in
    ``dualframe.collectives``).

    Example:
        >>> from dualframe.tensorflow.collectives import TFCollectives  # doctest: +SKIP
        >>> c = TFCollectives(); c.init()                           # doctest: +SKIP
        >>> c.allreduce(tf.ones(2), op="sum")                       # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__(hvd, "dualframe.tensorflow")

    def byte_tensor(self, data: bytes) -> tf.Tensor:
        return tf.constant(np.frombuffer(data, dtype=np.uint8))

    def int64_tensor(self, values: Sequence[int]) -> tf.Tensor:
        return tf.constant(list(values), dtype=tf.int64)

    def host_bytes(self, tensor: tf.Tensor) -> bytes:
        return bytes(tensor.numpy().tobytes())

    def guard(self, what: str) -> ContextManager[None]:
        """Bound an eager Horovod collective (``dualframe.tensorflow.reliability.failure.eager_guard``)."""
        from dualframe.tensorflow.reliability.failure import eager_guard

        return eager_guard(what)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        # horovod.tensorflow 0.28 has no barrier; functions.barrier is the one-number allreduce (imported
        # here because functions imports this module).
        from dualframe.tensorflow.functions import barrier

        barrier()


class TFBatchOps:
    """Split and concatenate TensorFlow batches along the first axis (the core's BatchOps protocol)."""

    def split(self, batch: tf.Tensor, sizes: Sequence[int]) -> List[tf.Tensor]:
        return list(tf.split(batch, list(sizes), axis=0))

    def concat(self, parts: Sequence[tf.Tensor]) -> tf.Tensor:
        return tf.concat(list(parts), axis=0)


class TFCaster:
    """dtype names and casts for TensorFlow tensors (the core's TensorCaster protocol)."""

    def dtype_name(self, tensor: tf.Tensor) -> str:
        return tf.as_dtype(tensor.dtype).name

    def cast(self, tensor: tf.Tensor, dtype_name: str) -> tf.Tensor:
        return tf.cast(tensor, tf.as_dtype(dtype_name))


collectives = TFCollectives()
#: Core op names -> Horovod's op constants.
OPS = collectives.ops
op_of = collectives.op_of
check_initialized = collectives.check_initialized

# Under a launcher, a rank that fails or stalls ends the whole job, naming itself and the cause.
from dualframe.reliability import failure as _failure  # noqa: E402
from dualframe.launch import mpi_defaults as _mpi_defaults  # noqa: E402

_failure.install()
# Before hvd.init() starts MPI: waits that give the core away (dualframe.launch.mpi_defaults).
_mpi_defaults.apply()

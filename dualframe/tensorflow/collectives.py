"""TensorFlow collectives over horovod.tensorflow, implementing the core's Collectives protocol."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from dualframe._deps import require
from dualframe.errors import NotInitializedError, StrategyError
from dualframe.strategy import REDUCE_OPS

hvd = require("horovod.tensorflow", "Horovod for TensorFlow (horovod.tensorflow)")

#: Core op names -> Horovod's op constants.
OPS: Dict[str, object] = {
    "average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum,
    "min": hvd.Min, "max": hvd.Max, "product": hvd.Product,
}
assert set(OPS) == set(REDUCE_OPS)


def op_of(op: object) -> object:
    """Horovod's op for a core op name or a Horovod op constant."""
    if isinstance(op, str):
        if op.lower() not in OPS:
            raise StrategyError(f"unknown op {op!r}; choose one of {', '.join(REDUCE_OPS)}")
        return OPS[op.lower()]
    if op in OPS.values():
        return op
    raise StrategyError(f"unknown op {op!r}; use one of hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max")


def check_initialized(what: str) -> None:
    """Raise NotInitializedError naming ``what`` unless Horovod is running."""
    if not hvd.is_initialized():
        raise NotInitializedError(f"{what} needs dualframe.tensorflow.init() first (call hvd.init() at the top of the script)")


class TFCollectives:
    """Horovod collectives on TensorFlow tensors (the core's Collectives protocol).

    Example:
        >>> from dualframe.tensorflow.collectives import TFCollectives  # doctest: +SKIP
        >>> c = TFCollectives(); c.init()                                # doctest: +SKIP
        >>> c.allreduce(tf.ones(2), op="sum")                            # doctest: +SKIP
    """

    def init(self, process_sets: Any = None) -> None:
        """Start Horovod once; later calls do nothing.

        ``process_sets``: lists of ranks, Horovod's ``hvd.ProcessSet`` objects (passed on as they are:
        Horovod gives them their ids) or ``"dynamic"``, as ``horovod.tensorflow.init`` takes them.
        """
        if not hvd.is_initialized():
            if process_sets == "dynamic":
                hvd.init(process_sets="dynamic")
            elif process_sets:
                hvd.init(process_sets=[ranks if isinstance(ranks, hvd.ProcessSet) else hvd.ProcessSet(list(ranks))
                                       for ranks in process_sets])
            else:
                hvd.init()

    def is_initialized(self) -> bool:
        return bool(hvd.is_initialized())

    def rank(self) -> int:
        check_initialized("rank()")
        return int(hvd.rank())

    def size(self) -> int:
        check_initialized("size()")
        return int(hvd.size())

    def allreduce(self, tensor: tf.Tensor, op: str = "average", name: Optional[str] = None) -> tf.Tensor:
        check_initialized("allreduce")
        return hvd.allreduce(tensor, name=name, op=op_of(op))

    def broadcast(self, tensor: tf.Tensor, root_rank: int, name: Optional[str] = None) -> tf.Tensor:
        check_initialized("broadcast")
        return hvd.broadcast(tensor, root_rank, name=name)

    def allgather(self, tensor: tf.Tensor, name: Optional[str] = None) -> tf.Tensor:
        check_initialized("allgather")
        return hvd.allgather(tensor, name=name)

    def barrier(self) -> None:
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

# Under a launcher, a rank that fails or stalls ends the whole job, naming itself and the cause.
from dualframe.reliability import failure as _failure  # noqa: E402
from dualframe.launch import mpi_defaults as _mpi_defaults  # noqa: E402

_failure.install()
# Before hvd.init() starts MPI: waits that give the core away (dualframe.launch.mpi_defaults).
_mpi_defaults.apply()

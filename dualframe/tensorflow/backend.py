"""The TensorFlow backend: the one object implementing the core's ``Backend`` protocol (``dualframe.backend``)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from dualframe.pipeline.mpi_direct import MPIDirect
from dualframe.reliability.checkpoint import split_gathered
from dualframe.tensorflow.collectives import TFBatchOps, TFCaster, TFCollectives, collectives, hvd
from dualframe.tensorflow.failure import eager_guard
from dualframe.tensorflow.pipeline_transport import TFWire, point_to_point, process_sets


class TFPlacement:
    """TensorFlow's devices for a stage (the core's ``Placement``): logical devices, CPUs first.

    Example:
        >>> TFPlacement().device("/GPU:0"), TFPlacement().device(None)   # doctest: +SKIP
        ('/GPU:0', None)
    """

    def available_devices(self) -> List[str]:
        """The logical devices TensorFlow can place on here (``"/CPU:0"``, ``"/GPU:1"``)."""
        from dualframe.tensorflow.model_parallel import available_devices

        return available_devices()

    def device(self, name: Optional[str]) -> Optional[str]:
        """The device name as given (``tf.device`` takes it); None keeps TensorFlow's default placement."""
        return name if name else None


def _distributed() -> bool:
    return bool(hvd.is_initialized()) and int(hvd.size()) > 1


def gather_bytes(data: bytes, name: str, process_set: Any = None) -> List[bytes]:
    """Every rank's ``data`` (of ``process_set``, default all), in rank order (only this rank's outside a distributed job)."""
    if not _distributed():
        return [data]
    group = {} if process_set is None else {"process_set": process_set}
    with eager_guard(name):
        lengths = hvd.allgather(tf.constant([len(data)], dtype=tf.int64), name=f"{name}.lengths", **group).numpy()
        joined = hvd.allgather(tf.constant(np.frombuffer(data, dtype=np.uint8)), name=f"{name}.bytes", **group).numpy()
    return split_gathered(joined.tobytes(), lengths.tolist())


def broadcast_bytes(data: Optional[bytes], root_rank: int, name: str, process_set: Any = None) -> bytes:
    """Root's ``data`` on every rank (of ``process_set``, default all; ``b""`` when root has none)."""
    if not _distributed():
        return data or b""
    group = {} if process_set is None else {"process_set": process_set}
    with eager_guard(name):
        length = hvd.broadcast(tf.constant([len(data or b"")], dtype=tf.int64), root_rank, name=f"{name}.length",
                               **group)
        size = int(length.numpy()[0])
        if size == 0:
            return b""
        buffer = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(size, dtype=np.uint8)
        return hvd.broadcast(tf.constant(buffer), root_rank, name=f"{name}.bytes", **group).numpy().tobytes()


class TFBackend:
    """TensorFlow under the core's ``Backend``: collectives, casts, batch split, placement, pipeline wire, checkpoint bytes.

    Example:
        >>> from dualframe.tensorflow.backend import BACKEND              # doctest: +SKIP
        >>> BACKEND.batches.split(tf.range(6), [4, 2])                     # doctest: +SKIP
    """

    name = "tensorflow"

    def __init__(self) -> None:
        self.collectives: TFCollectives = collectives
        self.caster = TFCaster()
        self.batches = TFBatchOps()
        self.placement = TFPlacement()

    def wire(self, device: Optional[str]) -> TFWire:
        """``TFWire`` (its receive buffers follow TensorFlow's placement: ``device`` is not needed)."""
        return TFWire()

    def point_to_point(self, device: Optional[str], chunks: int, name: str) -> Optional[MPIDirect[tf.Tensor]]:
        """MPI point-to-point when every rank has it, else None (a collective)."""
        return point_to_point(device, chunks, name)

    def process_sets(self, needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
        """Horovod process sets for ``needed`` (``dualframe.pipeline.layout.resolve_process_sets``)."""
        return process_sets(needed)

    def gather_bytes(self, data: bytes, name: str, process_set: Any = None) -> List[bytes]:
        """See ``gather_bytes``."""
        return gather_bytes(data, name, process_set)

    def broadcast_bytes(self, data: Optional[bytes], root_rank: int, name: str, process_set: Any = None) -> bytes:
        """See ``broadcast_bytes``."""
        return broadcast_bytes(data, root_rank, name, process_set)


#: The TensorFlow adapter's one Backend.
BACKEND = TFBackend()

"""The TensorFlow calls a pipeline link needs: tensors, Horovod broadcasts and allreduces on threads (the core's ``Wire``),
and host byte buffers for point-to-point (the core's ``PointToPoint``, ``point_to_point``: MPI when the job runs
on MPI, else ZeroMQ; ``dualframe.pipeline.direct`` chooses).

What moves, when, under which name, and how long a wait may last is the core's
(``dualframe.pipeline.link``), the same as torch's. Two TensorFlow facts are worked around here:

* Horovod's TF ops in eager mode block the caller and all carry their op type as Horovod's name,
  so two in flight at once collide ("a tensor with the same name ... is being processed"). Each
  message is therefore a small ``tf.function`` named after the message (traced once per name and
  shape), run on a daemon worker thread of its own (reused once idle): sends return at once,
  receives are posted ahead.
* A blocking op cannot be polled, so a wait is ``Event.wait(timeout)`` on that thread.

Names carry no step number (``StageLink(step_names=False)``): a name comes back only after this
rank's previous op of that name finished (every step waits for its sends), which is all Horovod asks.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from dualframe.pipeline.direct import Direct, open_direct
from dualframe.pipeline.link import Shape
from dualframe.pipeline.layout import DTYPE_NAMES, dtype_code, resolve_process_sets
from dualframe.tensorflow.collectives import hvd

#: dtypes a message may carry, by code (the header's last field); the same codes as torch's.
DTYPES = tuple(tf.as_dtype(name) for name in DTYPE_NAMES)


def tf_dtype_code(dtype: Any) -> int:
    """Code of a TensorFlow dtype in DTYPES; StrategyError for others."""
    return dtype_code(tf.as_dtype(dtype).name)


def process_sets(needed: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], Any]:
    """Horovod ProcessSets for the rank groups ``needed`` (see ``dualframe.pipeline.layout.resolve_process_sets``)."""
    from horovod.common import process_sets as registry

    return resolve_process_sets(hvd, registry, needed)


class _Workers:
    """Daemon threads that run one blocking call each and then wait for the next: a thread is started only when none is idle.

    Starting a thread per message made the caller wait until the new thread was scheduled, which on
    a box whose cores are busy computing took milliseconds per message, on the pipeline's critical path.
    """

    def __init__(self) -> None:
        self._idle: "queue.SimpleQueue[queue.SimpleQueue[Callable[[], None]]]" = queue.SimpleQueue()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on an idle worker, or on a new one."""
        try:
            inbox = self._idle.get_nowait()
        except queue.Empty:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), daemon=True, name="dualframe-pipeline-op").start()
        inbox.put(job)

    def _serve(self, inbox: "queue.SimpleQueue[Callable[[], None]]") -> None:
        while True:
            inbox.get()()
            self._idle.put(inbox)


_WORKERS = _Workers()


class Pending:
    """One Horovod op running on a worker thread of its own; ``done`` waits for it, bounded; ``result`` gives it.

    Example:
        >>> pending = Pending(lambda: 42)
        >>> pending.done(timeout=5.0), pending.result()
        (True, 42)
    """

    def __init__(self, call: Callable[[], Any]) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        _WORKERS.submit(lambda: self._run(call))

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._value = call()
        except BaseException as error:  # handed to the waiting thread, which raises it
            self._error = error
        finally:
            self._done.set()

    def done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; whether the op finished."""
        return self._done.wait(timeout)

    def result(self) -> Any:
        """The finished op's result, or the error it raised."""
        if self._error is not None:
            raise self._error
        return self._value


_FUNCTIONS: Dict[Tuple[str, str, int, int], Callable[..., Any]] = {}


class _QuietTracing(logging.Filter):
    """Drops TensorFlow's "frequent retracing" warning about our message functions: one trace per name is the design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_named.<locals>.run" not in record.getMessage()


tf.get_logger().addFilter(_QuietTracing())


def _named(kind: str, name: str, root_or_op: int, process_set: Any) -> Callable[..., Any]:
    """A tf.function running one Horovod op under Horovod's name ``name`` (made once per name)."""
    key = (kind, name, int(root_or_op), int(process_set.process_set_id))
    if key not in _FUNCTIONS:
        if kind == "broadcast":
            def run(tensor: Any) -> Any:
                return hvd.broadcast(tensor, root_or_op, name=name, ignore_name_scope=True, process_set=process_set)
        else:
            def run(tensor: Any) -> Any:
                return hvd.allreduce(tensor, op=root_or_op, name=name, ignore_name_scope=True,
                                     process_set=process_set)
        _FUNCTIONS[key] = tf.function(run, autograph=False, reduce_retracing=True)
    return _FUNCTIONS[key]


def broadcast(tensor: Any, root_rank: int, name: str, process_set: Any) -> Pending:
    """Start a named broadcast from ``root_rank`` in ``process_set`` (returns at once)."""
    run = _named("broadcast", name, root_rank, process_set)
    return Pending(lambda: run(tensor))


def allreduce(tensor: Any, op: Any, name: str, process_set: Any) -> Pending:
    """Start a named allreduce with Horovod's ``op`` in ``process_set`` (returns at once)."""
    run = _named("allreduce", name, op, process_set)
    return Pending(lambda: run(tensor))


class TFWire:
    """``horovod.tensorflow`` under the core's ``Wire``: each op a named ``tf.function`` on its own thread.

    Example:
        >>> wire = TFWire()                                                          # doctest: +SKIP
        >>> handle = wire.broadcast(x, 0, "x", hvd.global_process_set)               # doctest: +SKIP
        >>> wire.done(handle, timeout=5.0) and wire.result(handle)                    # doctest: +SKIP
    """

    def tensor(self, values: Sequence[float], code: int) -> tf.Tensor:
        return tf.constant(list(values), DTYPES[code])

    def empty(self, shape: Tuple[int, ...], code: int) -> Any:
        # A host array, not a tensor: point-to-point receives write into it as it is (no zeros, no second buffer).
        return np.empty(shape, DTYPES[code].as_numpy_dtype)

    def describe(self, tensor: Any) -> Shape:
        return tuple(int(d) for d in tensor.shape), tf_dtype_code(tensor.dtype)

    def values(self, tensor: Any) -> List[Any]:
        return list(np.asarray(tensor).flatten().tolist())

    def broadcast(self, tensor: Any, root_rank: int, name: str, process_set: Any) -> Pending:
        return broadcast(tf.convert_to_tensor(tensor), root_rank, name, process_set)

    def allreduce(self, tensor: Any, op: str, name: str, process_set: Any) -> Pending:
        return allreduce(tf.convert_to_tensor(tensor), hvd.Sum if op == "sum" else hvd.Average, name, process_set)

    def done(self, handle: Pending, timeout: float) -> bool:
        return handle.done(timeout)

    def result(self, handle: Pending) -> tf.Tensor:
        return handle.result()

    def stopped(self, error: BaseException) -> Optional[str]:
        if not isinstance(error, tf.errors.OpError):
            return None
        return (error.message.strip().splitlines() or [""])[0]


def _byte_view(tensor: Any) -> Any:
    # A flat byte view of the host memory (a packed message is a host array already): MPI moves any dtype as bytes.
    return np.ascontiguousarray(np.asarray(tensor)).reshape(-1).view(np.uint8)


def _receive_into(buffer: Any) -> Tuple[Any, Callable[[], Any]]:
    # The wire's buffers are host arrays of their own (``TFWire.empty``): the transport writes into them, the receiver
    # reads them as they are. A tensor's memory is not ours to write: another buffer of its shape then.
    array = buffer if isinstance(buffer, np.ndarray) else np.empty(tuple(buffer.shape), buffer.dtype.as_numpy_dtype)
    return array.reshape(-1).view(np.uint8), lambda: array


def point_to_point(device: Optional[str], chunks: int, name: str, transport: Optional[str] = None) -> Optional[Direct]:
    """MPI or ZeroMQ point-to-point for a pipeline when every rank has it (``dualframe.pipeline.direct.open_direct``); else None.

    A collective over every rank: call it on all of them.

    Raises:
        StrategyError: a bad or uneven ``transport`` / ``DUALFRAME_PIPELINE_TRANSPORT``, or "mpi" / "zmq" where a rank lacks it.
    """
    def vote(votes: List[int]) -> List[int]:
        total = hvd.allreduce(tf.constant(votes, tf.int64), op=hvd.Sum, name=f"{name}.transport")
        return [int(v) for v in total.numpy()]

    def gather(entry: Any) -> List[Any]:
        return list(hvd.allgather_object(entry, name=f"{name}.addresses"))

    on_cpu = "" if device is None or (tf.DeviceSpec.from_string(device).device_type or "CPU").upper() == "CPU" else device
    return open_direct(on_cpu, bool(hvd.mpi_enabled()), int(hvd.rank()), int(hvd.size()), chunks, vote, gather,
                       _byte_view, _receive_into, transport)

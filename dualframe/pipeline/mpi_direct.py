"""MPI point-to-point for pipeline messages (the core's ``PointToPoint``), shared by both adapters.

Framework-neutral: each adapter hands in two small calls, a byte view of a tensor to send, and a
writable byte buffer for a tensor to receive (with the call that turns it back into a tensor), plus
Horovod's facts and a sum over every rank for the vote. mpi4py is imported only when a pipeline
asks for MPI, so importing this module loads no MPI. ``dualframe.pipeline.direct`` decides whether a
pipeline uses it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Generic, Optional, Tuple, TypeVar

from dualframe.pipeline.link import largest_tag

T = TypeVar("T")

#: A tensor to send -> a buffer MPI can read (kept alive with the request).
Outgoing = Callable[[Any], Any]
#: A receive buffer from the wire -> (a buffer MPI can write, the call that gives the received tensor).
Incoming = Callable[[Any], Tuple[Any, Callable[[], Any]]]


def poll(finished: Callable[[], Any], timeout: float) -> bool:
    """Call ``finished()`` until it is true, sleeping at most 0.2 ms between calls; False after ``timeout`` s.

    Example:
        >>> poll(lambda: True, timeout=1.0), poll(lambda: False, timeout=0.01)
        (True, False)
    """
    deadline = time.monotonic() + timeout
    pause = 0.0
    while not finished():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(0.0002, pause + 0.00005)
    return True


class MPIDirect(Generic[T]):
    """MPI's nonblocking send and receive on a communicator of the pipeline's own (a ``PointToPoint``).

    Args:
        comm: an mpi4py communicator (``MPI.COMM_WORLD.Dup()``: tags of its own).
        outgoing: the adapter's byte view of a tensor to send.
        incoming: the adapter's writable buffer for a receive, and how to read the tensor back.

    Example:
        >>> direct = MPIDirect(MPI.COMM_WORLD.Dup(), outgoing=byte_view, incoming=receive_buffer)  # doctest: +SKIP
        >>> handle = direct.send(x, dest=1, tag=0); direct.done(handle, timeout=5.0)        # doctest: +SKIP
    """

    name = "mpi"

    def __init__(self, comm: Any, outgoing: Outgoing, incoming: Incoming) -> None:
        self.comm, self.outgoing, self.incoming = comm, outgoing, incoming

    def send(self, tensor: T, dest: int, tag: int) -> Any:
        data = self.outgoing(tensor)
        return self.comm.Isend(data, dest=dest, tag=tag), lambda: tensor, data  # data lives as long as the request

    def receive(self, buffer: T, source: int, tag: int) -> Any:
        data, read = self.incoming(buffer)
        return self.comm.Irecv(data, source=source, tag=tag), read, data

    def done(self, handle: Any, timeout: float) -> bool:
        return poll(handle[0].Test, timeout)

    def result(self, handle: Any) -> T:
        return handle[1]()  # type: ignore[no-any-return]

    def stopped(self, error: BaseException) -> Optional[str]:
        return None  # MPI's errors abort the job (MPI_ERRORS_ARE_FATAL): nothing here to explain


def missing(on_cpu: str, horovod_on_mpi: bool, rank: int, size: int, chunks: int) -> Optional[str]:
    """Why this rank cannot send pipeline messages over MPI point-to-point; None when it can.

    Args:
        on_cpu: "" when the stage's tensors are on the host, else the device's name.
        horovod_on_mpi: Horovod's ``mpi_enabled()``; ``rank``, ``size``: Horovod's.
        chunks: micro-batches per step (MPI's tag bound must number their messages).
    """
    if on_cpu:
        return f"the stage is on {on_cpu} (MPI moves host tensors here; device tensors go through Horovod)"
    if not horovod_on_mpi:
        return "Horovod runs on Gloo, not MPI (horovodrun --gloo)"
    try:
        from mpi4py import MPI
    except ImportError:
        return "mpi4py is not installed"
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return "MPI was started without MPI_THREAD_MULTIPLE (Horovod's thread uses MPI too)"
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (rank, size):
        return "Horovod's ranks are not MPI_COMM_WORLD's (hvd.init(comm=...))"
    if int(world.Get_attr(MPI.TAG_UB) or 0) < largest_tag(chunks):
        return f"MPI's largest tag is below {largest_tag(chunks)} (chunks: {chunks})"
    return None

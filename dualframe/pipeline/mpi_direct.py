"""MPI point-to-point for pipeline messages (the core's ``PointToPoint``), shared by both adapters.

Framework-neutral: each adapter hands in two small calls, a byte view of a tensor to send, and a
writable byte buffer for a tensor to receive (with the call that turns it back into a tensor), plus
Horovod's facts and a sum over every rank for the vote. mpi4py is imported only when a pipeline
asks for MPI, so importing this module loads no MPI. ``dualframe.pipeline.direct`` decides whether a
pipeline uses it.
"""
from __future__ import annotations

import atexit
import sys
import time
import weakref
from typing import Any, Callable, Dict, Generic, List, Optional, Tuple, TypeVar

from dualframe.pipeline.link import largest_tag

T = TypeVar("T")

#: A tensor to send -> a buffer MPI can read (kept alive with the request).
Outgoing = Callable[[Any], Any]
#: A receive buffer from the wire -> (a buffer MPI can write, the call that gives the received tensor).
Incoming = Callable[[Any], Tuple[Any, Callable[[], Any]]]


#: The longest pause between two tests of a wait (s): a message that lands during a pause waits at most this long.
MAX_PAUSE_S = 0.001
#: A pause is at most this share of the time waited so far, so a wait adds at most that share to its length.
PAUSE_SHARE = 0.05


def pause_after(waited: float) -> float:
    """Seconds to sleep before the next test of a wait that has lasted ``waited`` s (the back-off of ``poll``).

    A short wait (the next micro-batch already on the wire) tests again at once; a long one (a stage
    idle in the bubble) sleeps longer, up to ``MAX_PAUSE_S``, so it wakes about a thousand times a
    second instead of thousands: each wakeup takes a core from whatever computes there.

    Example:
        >>> pause_after(0.0), pause_after(0.004), pause_after(10.0)
        (0.0, 0.0002, 0.001)
    """
    return min(MAX_PAUSE_S, waited * PAUSE_SHARE)


def poll(finished: Callable[[], Any], timeout: float) -> bool:
    """Call ``finished()`` until it is true, sleeping ``pause_after`` the time waited between calls; False after ``timeout`` s.

    MPI has no wait that sleeps in the kernel (its blocking ``Wait`` polls a core), so this sleeps
    between nonblocking tests instead: the thread holds no core while it sleeps.

    Example:
        >>> poll(lambda: True, timeout=1.0), poll(lambda: False, timeout=0.01)
        (True, False)
    """
    start = time.monotonic()
    while not finished():
        waited = time.monotonic() - start
        if waited > timeout:
            return False
        time.sleep(pause_after(waited))
    return True


class _Request:
    """One nonblocking send or receive: MPI's request, the buffer MPI reads or writes, and how to read the result."""

    __slots__ = ("request", "read", "data", "receiving", "__weakref__")

    def __init__(self, request: Any, read: Callable[[], Any], data: Any, receiving: bool) -> None:
        self.request, self.read, self.data, self.receiving = request, read, data, receiving


class InFlight:
    """The requests a transport posted that MPI has not yet completed, holding their buffers alive.

    A buffer freed while MPI may still write into it (a receive posted ahead, left behind by a pipeline
    that stopped on an error) corrupts the heap; one freed under a send MPI still reads sends garbage.
    ``cancel`` ends what can end: receives are cancelled and waited for, completed sends dropped; a send
    to a peer that never takes it cannot be cancelled (MPI deprecates cancelling sends), so its buffer is
    kept until the process exits (``_KEPT``).

    Example:
        >>> flight = InFlight(); flight.cancel(timeout=0.1)   # nothing posted: nothing to do
        0
    """

    def __init__(self) -> None:
        self.requests: Dict[int, _Request] = {}

    def add(self, request: _Request) -> _Request:
        self.requests[id(request)] = request
        return request

    def finished(self, request: _Request) -> None:
        self.requests.pop(id(request), None)

    def cancel(self, timeout: float = 5.0) -> int:
        """Cancel every pending receive and wait (at most ``timeout`` s in all) for it and every send; return what is left.

        What is still pending afterwards (sends nobody receives) moves to ``_KEPT`` with its buffer.
        """
        pending, self.requests = list(self.requests.values()), {}
        mpi = sys.modules.get("mpi4py.MPI")  # requests exist only once mpi4py loaded MPI; never load it here
        if mpi is not None and mpi.Is_finalized():  # nothing may call MPI now; nor does MPI touch the buffers
            _KEPT.extend(pending)
            return len(pending)
        for item in pending:
            if item.receiving and not item.request.Test():
                item.request.Cancel()
        deadline = time.monotonic() + timeout
        left = [item for item in pending if not poll(item.request.Test, max(0.0, deadline - time.monotonic()))]
        _KEPT.extend(left)
        return len(left)


#: Requests MPI never completed (a send to a peer that is gone): their buffers must outlive MPI.
_KEPT: List[_Request] = []
#: Every open transport's requests; at exit they end before mpi4py finalizes MPI (its Py_AtExit runs after atexit's).
_OPEN: "weakref.WeakSet[InFlight]" = weakref.WeakSet()


@atexit.register
def _cancel_open() -> None:
    for flight in list(_OPEN):
        flight.cancel(timeout=2.0)


class MPIDirect(Generic[T]):
    """MPI's nonblocking send and receive on a communicator of the pipeline's own (a ``PointToPoint``).

    Every request it posts is completed or cancelled before its buffer is freed: when the transport is
    closed (``close``) or collected, and at exit before MPI is finalized (see ``InFlight``).

    Args:
        comm: an mpi4py communicator (``MPI.COMM_WORLD.Dup()``: tags of its own).
        outgoing: the adapter's byte view of a tensor to send.
        incoming: the adapter's writable buffer for a receive, and how to read the tensor back.

    Example:
        >>> direct = MPIDirect(MPI.COMM_WORLD.Dup(), outgoing=byte_view, incoming=receive_buffer)  # doctest: +SKIP
        >>> handle = direct.send(x, dest=1, tag=0); direct.done(handle, timeout=5.0)        # doctest: +SKIP
        >>> direct.close()                                                                  # doctest: +SKIP
    """

    name = "mpi"

    def __init__(self, comm: Any, outgoing: Outgoing, incoming: Incoming) -> None:
        self.comm, self.outgoing, self.incoming = comm, outgoing, incoming
        self.in_flight = InFlight()
        _OPEN.add(self.in_flight)
        self._closer = weakref.finalize(self, self.in_flight.cancel)

    def send(self, tensor: T, dest: int, tag: int) -> Any:
        data = self.outgoing(tensor)
        return self.in_flight.add(_Request(self.comm.Isend(data, dest=dest, tag=tag), lambda: tensor, data, False))

    def receive(self, buffer: T, source: int, tag: int) -> Any:
        data, read = self.incoming(buffer)
        return self.in_flight.add(_Request(self.comm.Irecv(data, source=source, tag=tag), read, data, True))

    def done(self, handle: Any, timeout: float) -> bool:
        if not poll(handle.request.Test, timeout):
            return False
        self.in_flight.finished(handle)
        return True

    def result(self, handle: Any) -> T:
        return handle.read()  # type: ignore[no-any-return]

    def stopped(self, error: BaseException) -> Optional[str]:
        return None  # MPI's errors abort the job (MPI_ERRORS_ARE_FATAL): nothing here to explain

    def close(self) -> None:
        """Cancel the receives still posted and wait for the sends (bounded); later calls do nothing."""
        self._closer()


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

"""ZeroMQ point-to-point for pipeline messages where there is no MPI world (``horovodrun --gloo``), shared by both adapters.

Shaped like ``dualframe.pipeline.mpi_direct.MPIDirect`` (the core's ``PointToPoint``): the adapter
hands in a byte view of a tensor to send and a writable byte buffer to receive into. pyzmq moves the
bytes: each rank binds one PULL socket per pipeline on a free TCP port of one address (the loopback
when the job is on one host, else the launcher's interface: ``zmq_auth.listen_address``), the ranks
exchange their addresses and rank 0's secret in one Horovod allgather when the pipeline is built
(``open_zmq``), and a rank connects a PUSH socket to a peer the first time it talks to it. ZeroMQ's
own I/O thread moves the bytes, so a send returns at once (the bytes are copied into ZeroMQ's queue)
and no Horovod cycle sits between two stages. A message is two frames, a header sealed with the
secret (``zmq_auth.MessageSeal``: sender, receiver, tag, counter, length, HMAC-SHA256) then the
bytes; a message that does not open is dropped and counted (``ZMQDirect.dropped``), and a receive
matches the oldest genuine message of its (rank, tag), as MPI's matching does.

A wait polls the PULL socket (the caller's thread sleeps in ZeroMQ's poll, not in a busy loop), and
a socket monitor on each peer's PUSH socket tells when that peer's connection dropped or is refused
(its process died, before or after we first connected), which ends a wait on that peer with ``PeerLostError`` after ``GRACE_S`` (its last messages may
still be on their way); a silent peer ends it at the link's timeout. pyzmq
is imported only when a pipeline opens this transport, so importing this module loads no ZeroMQ.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import os
import socket
import time
import weakref
from typing import Any, Callable, Deque, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar

from dualframe.errors import StrategyError
from dualframe.pipeline.layout import PeerLostError
from dualframe.pipeline.zmq_auth import MessageSeal, job_seal, listen_address, rank_0_share, unreachable

T = TypeVar("T")

#: How long (ms) a closing rank keeps trying to deliver messages still queued to a peer that is alive.
LINGER_MS = 10_000
#: How long (s) a wait goes on after a peer's connection dropped: its last messages travel on another connection.
GRACE_S = 2.0

_CONTEXT: List[Any] = []
_MONITORS = itertools.count()


def _context() -> Any:
    """The process's one ZeroMQ context (one I/O thread), closed at exit after queued messages went out."""
    if not _CONTEXT:
        import zmq

        context = zmq.Context(io_threads=1)
        atexit.register(context.destroy)  # each socket's own LINGER bounds how long this waits
        _CONTEXT.append(context)
    return _CONTEXT[0]


def endpoints(everyone: Sequence[Sequence[Any]]) -> List[str]:
    """Where this rank reaches each rank's PULL socket: the address that rank listens on.

    Args:
        everyone: every rank's (address, port, ...) from the allgather, in rank order.

    Example:
        >>> endpoints([("127.0.0.1", 5, b""), ("10.0.0.2", 7, b"")])
        ['tcp://127.0.0.1:5', 'tcp://10.0.0.2:7']
    """
    return [f"tcp://{address}:{port}" for address, port, *_ in everyone]


class _Message:
    """A send or receive in flight: ``filled`` once its bytes are in place; ``read`` gives the tensor."""

    __slots__ = ("buffer", "read", "filled", "source", "tag")

    def __init__(self, buffer: Any, read: Callable[[], Any], filled: bool, source: int = -1, tag: int = -1) -> None:
        self.buffer, self.read, self.filled, self.source, self.tag = buffer, read, filled, source, tag

    def fill(self, frame: Any) -> None:
        target = memoryview(self.buffer).cast("B")
        data = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
        if data.nbytes != target.nbytes:
            raise ValueError(f"message {self.tag} from rank {self.source} has {data.nbytes} bytes where "
                             f"{target.nbytes} were expected (the ranks disagree on a message's shape)")
        target[:] = data
        self.filled = True


class ZMQDirect(Generic[T]):
    """Nonblocking send and receive over ZeroMQ between a pipeline's ranks (a ``PointToPoint``).

    Args:
        rank: this process's rank; ``inbox``: its bound PULL socket; ``peers``: each rank's endpoint.
        outgoing: the adapter's byte view of a tensor to send.
        incoming: the adapter's writable buffer for a receive, and how to read the tensor back.
        seal: seals what this rank sends and opens what it receives (the pipeline's secret).

    Example:
        >>> direct = open_zmq(rank, gather, outgoing=byte_view, incoming=receive_buffer)  # doctest: +SKIP
        >>> handle = direct.send(x, dest=1, tag=0); direct.done(handle, timeout=5.0)     # doctest: +SKIP
    """

    name = "zmq"

    def __init__(self, rank: int, inbox: Any, peers: Sequence[str], outgoing: Callable[[Any], Any],
                 incoming: Callable[[Any], Tuple[Any, Callable[[], Any]]], seal: MessageSeal) -> None:
        import zmq

        self.zmq, self.rank, self.inbox, self.peers, self.seal = zmq, rank, inbox, list(peers), seal
        self.outgoing, self.incoming = outgoing, incoming
        self._outboxes: Dict[int, Tuple[Any, Any]] = {}  # rank -> (PUSH socket, its monitor)
        self._posted: Dict[Tuple[int, int], Deque[_Message]] = collections.defaultdict(collections.deque)
        self._early: Dict[Tuple[int, int], Deque[Any]] = collections.defaultdict(collections.deque)
        self._lost: Dict[int, float] = {}  # rank -> when its connection dropped
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._sockets: List[Any] = [inbox]
        weakref.finalize(self, _close, self._sockets)

    def _outbox(self, rank: int) -> Any:
        if rank not in self._outboxes:
            zmq = self.zmq
            push = _context().socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # never block a send: the link bounds what is in flight
            push.setsockopt(zmq.LINGER, LINGER_MS)
            # An address of our own: pyzmq's default names it after the socket's file descriptor, which
            # a closed pipeline's socket may still hold, and its last events would reach this one.
            events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
            monitor = push.get_monitor_socket(events,
                                              addr=f"inproc://dualframe-monitor-{os.getpid()}-{next(_MONITORS)}")
            push.connect(self.peers[rank])
            self._poller.register(monitor, zmq.POLLIN)
            self._outboxes[rank] = (push, monitor)
            self._sockets += [monitor, push]
        return self._outboxes[rank][0]

    def send(self, tensor: T, dest: int, tag: int) -> Any:
        data = self.outgoing(tensor)
        self._outbox(dest).send_multipart([self.seal.seal(dest, tag, data), data], copy=True)
        return _Message(None, lambda: tensor, True)  # copied into ZeroMQ's queue: done

    def receive(self, buffer: T, source: int, tag: int) -> Any:
        data, read = self.incoming(buffer)
        message = _Message(data, read, False, source, tag)
        self._outbox(source)  # watch the peer's connection while waiting on it
        early = self._early.get((source, tag))
        if early:
            message.fill(early.popleft())
        else:
            self._posted[(source, tag)].append(message)
        return message

    @property
    def dropped(self) -> int:
        """How many messages this rank's socket dropped: not from the pipeline's ranks (forged, malformed) or replayed."""
        return self.seal.dropped

    def _drain(self) -> None:
        zmq = self.zmq
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            opened = self.seal.open(frames)  # None: not this pipeline's (dropped and counted)
            if opened is None:
                continue
            source, tag, body = opened
            key = (source, tag)
            waiting = self._posted.get(key)
            if waiting:
                waiting.popleft().fill(body)
            else:
                self._early[key].append(body)

    def _watch(self, ready: Dict[Any, int]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        for rank, (_, monitor) in self._outboxes.items():
            while monitor in ready and monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                # Refused (CONNECT_RETRIED): every rank bound its socket before the addresses were
                # exchanged, so a refusal means the peer's socket closed before we ever connected.
                if event in (self.zmq.EVENT_DISCONNECTED, self.zmq.EVENT_CONNECT_RETRIED):
                    self._lost.setdefault(rank, time.monotonic())
                elif event == self.zmq.EVENT_CONNECTED:  # ZeroMQ reconnected: the peer is alive
                    self._lost.pop(rank, None)

    def done(self, handle: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            if handle.filled:
                return True
            now = time.monotonic()
            if now - self._lost.get(handle.source, now) > GRACE_S:
                raise PeerLostError(f"rank {handle.source} closed its connection (its process ended); "
                                    "a neighbouring stage failed or exited")
            if now >= deadline:
                return False
            self._watch(dict(self._poller.poll(max(1, min(int((deadline - now) * 1000), 500)))))

    def result(self, handle: Any) -> T:
        return handle.read()  # type: ignore[no-any-return]

    def stopped(self, error: BaseException) -> Optional[str]:
        return None  # a peer that went raises PeerLostError itself (see done)


def _close(sockets: List[Any]) -> None:
    import zmq

    for sock in reversed(sockets):  # PUSH sockets first: each stops its monitor, then its LINGER lets queued messages out
        if sock.closed:  # the context's destroy at exit may have closed it first (atexit order is not ours)
            continue
        if sock.type == zmq.PUSH:
            sock.disable_monitor()
        sock.close()


def missing() -> Optional[str]:
    """Why this rank cannot send pipeline messages over ZeroMQ; None when it can."""
    try:
        import zmq  # noqa: F401
    except ImportError:
        return "pyzmq is not installed (pip install pyzmq)"
    return None


def open_zmq(rank: int, gather: Callable[[Any], List[Any]], outgoing: Callable[[Any], Any],
             incoming: Callable[[Any], Tuple[Any, Callable[[], Any]]]) -> ZMQDirect[Any]:
    """Bind this rank's PULL socket, exchange every rank's address and rank 0's secret (``gather``: the adapter's allgather of an object).

    A collective over every rank: call it on all of them. A rank that cannot bind says why in the
    allgather, so every rank raises alike.

    Raises:
        StrategyError: a rank could not listen on its address (``zmq_auth.listen_address``), or a bad
            ``DUALFRAME_PIPELINE_MAC`` (before the allgather).
    """
    import zmq

    share = rank_0_share(rank)  # a bad DUALFRAME_PIPELINE_MAC is refused here, on every rank
    inbox = _context().socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)  # take everything a peer sends; the link bounds it
    inbox.setsockopt(zmq.LINGER, 0)
    address, port, failure = "", 0, ""
    try:
        address = listen_address()
        port = inbox.bind_to_random_port(f"tcp://{address}")
    except (zmq.ZMQError, StrategyError) as error:
        failure = str(error)
    everyone = [tuple(entry) for entry in gather((address, int(port), failure, socket.gethostname(), share))]
    failed = "; ".join(f"rank {r}: {entry[2]} (address {entry[0]!r})" for r, entry in enumerate(everyone) if entry[2])
    if failed or unreachable(everyone):
        inbox.close(linger=0)
        raise StrategyError(f"a pipeline's ZeroMQ socket could not listen where its peers reach it "
                            f"({failed or unreachable(everyone)}); set DUALFRAME_PIPELINE_ADDRESS to an "
                            "address of each host that the others reach")
    return ZMQDirect(rank, inbox, endpoints(everyone), outgoing, incoming, job_seal(everyone, rank))

"""ZeroMQ point-to-point for pipeline messages where there is no MPI world (``horovodrun --gloo``), shared by both adapters.

Shaped like ``dualframe.pipeline.mpi_direct.MPIDirect`` (the core's ``PointToPoint``): the adapter
hands in a byte view of a tensor to send and a writable byte buffer to receive into. pyzmq moves the
bytes: each rank binds one PULL socket per pipeline on a free TCP port, the ranks exchange their
addresses in one Horovod allgather when the pipeline is built (``open_zmq``), and a rank connects a
PUSH socket to a peer the first time it talks to it. ZeroMQ's own I/O thread moves the bytes, so a
send returns at once (the bytes are copied into ZeroMQ's queue) and no Horovod cycle sits between two
stages. A message is two frames, ``(sender rank, tag)`` then the bytes; a receive matches the
oldest message of its (rank, tag), as MPI's matching does.

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
import struct
import time
import weakref
from typing import Any, Callable, Deque, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar

from dualframe.pipeline.layout import PeerLostError

T = TypeVar("T")

#: The first frame of a message: the sender's rank and the message's tag (two little-endian int64).
_HEAD = struct.Struct("<qq")
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


def host_address(environ: Optional[Dict[str, str]] = None) -> str:
    """The address other hosts reach this one at: horovodrun's Gloo interface, else this host's name resolved.

    ``DUALFRAME_PIPELINE_ADDRESS`` wins when set; ``HOROVOD_GLOO_IFACE`` (set by ``horovodrun --gloo``,
    the interface every host shares) is read through psutil (a Horovod requirement); then
    ``HOROVOD_HOSTNAME`` (the host's name in ``-H``) or this host's name, resolved.

    Example:
        >>> host_address({"DUALFRAME_PIPELINE_ADDRESS": "10.0.0.7"})
        '10.0.0.7'
    """
    env = os.environ if environ is None else environ
    if env.get("DUALFRAME_PIPELINE_ADDRESS"):
        return env["DUALFRAME_PIPELINE_ADDRESS"]
    interface = env.get("HOROVOD_GLOO_IFACE")
    if interface:
        try:
            import psutil

            for address in psutil.net_if_addrs().get(interface, []):
                if address.family == socket.AF_INET:
                    return str(address.address)
        except ImportError:
            pass
    name = env.get("HOROVOD_HOSTNAME") or socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def endpoints(mine: Tuple[str, str, int], everyone: Sequence[Tuple[str, str, int]]) -> List[str]:
    """Where this rank reaches each rank's PULL socket: the loopback on its own host, else the advertised address.

    Args:
        mine: this rank's (host name, address, port); ``everyone``: every rank's, in rank order.

    Example:
        >>> endpoints(("a", "10.0.0.1", 5), [("a", "10.0.0.1", 5), ("a", "10.0.0.1", 6), ("b", "10.0.0.2", 7)])
        ['tcp://127.0.0.1:5', 'tcp://127.0.0.1:6', 'tcp://10.0.0.2:7']
    """
    return [f"tcp://{'127.0.0.1' if host == mine[0] else address}:{port}" for host, address, port in everyone]


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

    Example:
        >>> direct = open_zmq(rank, gather, outgoing=byte_view, incoming=receive_buffer)  # doctest: +SKIP
        >>> handle = direct.send(x, dest=1, tag=0); direct.done(handle, timeout=5.0)     # doctest: +SKIP
    """

    name = "zmq"

    def __init__(self, rank: int, inbox: Any, peers: Sequence[str], outgoing: Callable[[Any], Any],
                 incoming: Callable[[Any], Tuple[Any, Callable[[], Any]]]) -> None:
        import zmq

        self.zmq, self.rank, self.inbox, self.peers = zmq, rank, inbox, list(peers)
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
        self._outbox(dest).send_multipart([_HEAD.pack(self.rank, tag), data], copy=True)
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

    def _drain(self) -> None:
        zmq = self.zmq
        while True:
            try:
                head, body = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            key = _HEAD.unpack(head.bytes)
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
    """Bind this rank's PULL socket, exchange every rank's address (``gather``: the adapter's allgather of an object).

    A collective over every rank: call it on all of them.
    """
    import zmq

    inbox = _context().socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)  # take everything a peer sends; the link bounds it
    inbox.setsockopt(zmq.LINGER, 0)
    port = inbox.bind_to_random_port("tcp://*")
    mine = (socket.gethostname(), host_address(), int(port))
    return ZMQDirect(rank, inbox, endpoints(mine, [tuple(entry) for entry in gather(mine)]), outgoing, incoming)

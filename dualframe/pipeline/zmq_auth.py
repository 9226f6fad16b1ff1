"""Who a pipeline's ZeroMQ sockets hear: the one address they listen on, and a keyed MAC on every message.

``zmq_direct`` binds each rank's PULL socket to ``listen_address()`` (the loopback when every rank of
the job is on this host, else the address the hosts reach each other at; never every interface) and
seals every message with ``MessageSeal``: HMAC-SHA256, under a secret rank 0 makes for the pipeline
and shares in the allgather that exchanges the addresses, over the sender, the receiver, the tag, a
per-receiver counter and the length (``DUALFRAME_PIPELINE_MAC=message``: and the bytes). A receiver
opens a message only when all of that checks out and its counter is newer than the sender's last
one (a replay is dropped); anything else is dropped and counted (``MessageSeal.dropped``), with one
warning per pipeline, never delivered.

The header alone is the default: ZeroMQ delivers a message's frames together on the sender's own
connection, so a stranger cannot put bytes under a genuine header without reading the job's
traffic, and whoever reads it has read the secret too (it travels in Horovod's allgather); hashing
the bytes costs about 1.4 GB/s on each side (``scripts/bench_zmq_auth.py``).
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets
import socket
import struct
import warnings
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from dualframe.errors import StrategyError
from dualframe.launch.topology import detect

#: Set to the address this host's ranks listen on and are reached at (it must be one of this host's).
ADDRESS_VARIABLE = "DUALFRAME_PIPELINE_ADDRESS"
#: What the MAC covers: "header" (sender, receiver, tag, counter, length; the default) or "message" (and the bytes).
MAC_VARIABLE = "DUALFRAME_PIPELINE_MAC"
MAC_SCOPES = ("header", "message")
#: The pipeline's secret: 32 random bytes from rank 0.
SECRET_BYTES = 32
#: A message's first frame: sender rank, receiver rank, tag, counter, body bytes (little-endian), then the MAC.
_FIELDS = struct.Struct("<qqqQQ")
_DIGEST = "sha256"
DIGEST_BYTES = hashlib.new(_DIGEST).digest_size
HEAD_BYTES = _FIELDS.size + DIGEST_BYTES
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")


def host_address(environ: Optional[Mapping[str, str]] = None) -> str:
    """The address other hosts reach this one at: horovodrun's Gloo interface, else this host's name resolved.

    ``DUALFRAME_PIPELINE_ADDRESS`` wins when set; ``HOROVOD_GLOO_IFACE`` (set by ``horovodrun --gloo``,
    the interface every host shares) is read through psutil (a Horovod requirement); then
    ``HOROVOD_HOSTNAME`` (the host's name in ``-H``) or this host's name, resolved.

    Example:
        >>> host_address({"DUALFRAME_PIPELINE_ADDRESS": "10.0.0.7"})
        '10.0.0.7'
    """
    env = os.environ if environ is None else environ
    if env.get(ADDRESS_VARIABLE):
        return env[ADDRESS_VARIABLE].strip()
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


def listen_address(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where this rank's pipeline socket listens, and is reached: one address, never every interface.

    ``DUALFRAME_PIPELINE_ADDRESS`` when set; else the loopback when the launcher put every rank on
    this host (its local size is the job's size); else ``host_address``.

    Example:
        >>> listen_address({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "2"})
        '127.0.0.1'
        >>> listen_address({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "1",
        ...                 "DUALFRAME_PIPELINE_ADDRESS": "10.0.0.7"})
        '10.0.0.7'

    Raises:
        StrategyError: ``DUALFRAME_PIPELINE_ADDRESS`` names every interface (``*``, ``0.0.0.0``, ``::``).
    """
    env = os.environ if environ is None else environ
    if ADDRESS_VARIABLE in env:
        chosen = env[ADDRESS_VARIABLE].strip()
        if chosen in _WILDCARDS:
            raise StrategyError(f"{ADDRESS_VARIABLE} must be one address of this host that the other hosts reach, "
                                f"not every interface ({ADDRESS_VARIABLE}={env[ADDRESS_VARIABLE]!r}); "
                                "unset it to use the launcher's interface")
        return chosen
    topology = detect(env)
    if topology.local_size == topology.size:
        return "127.0.0.1"
    return host_address(env)


def unreachable(entries: Sequence[Sequence[Any]]) -> str:
    """Why some rank cannot reach another's socket: one listens on a loopback address while the job spans hosts ("" if none).

    Args:
        entries: every rank's (address, port, failure, host name, ...) from the address allgather.

    Example:
        >>> unreachable([("127.0.0.1", 5, "", "a"), ("127.0.0.1", 6, "", "a")])
        ''
        >>> unreachable([("127.0.0.1", 5, "", "a"), ("10.0.0.2", 6, "", "b")])
        'rank 0 listens on 127.0.0.1 (host a), which ranks on b cannot reach'
    """
    hosts = sorted({str(entry[3]) for entry in entries})
    for rank, (address, _, _, host, *_) in enumerate(entries):
        if len(hosts) > 1 and (address.startswith("127.") or address in ("::1", "localhost")):
            others = ", ".join(h for h in hosts if h != host)
            return f"rank {rank} listens on {address} (host {host}), which ranks on {others} cannot reach"
    return ""


def new_secret() -> bytes:
    """A pipeline's secret (``SECRET_BYTES`` random bytes), made by rank 0 and shared with the addresses."""
    return secrets.token_bytes(SECRET_BYTES)


def mac_scope(environ: Optional[Mapping[str, str]] = None) -> str:
    """What the MAC covers, from ``DUALFRAME_PIPELINE_MAC``: "header" (unset) or "message".

    Example:
        >>> mac_scope({}), mac_scope({"DUALFRAME_PIPELINE_MAC": " Message "})
        ('header', 'message')

    Raises:
        StrategyError: another value.
    """
    value = (os.environ if environ is None else environ).get(MAC_VARIABLE, "").strip().lower() or "header"
    if value not in MAC_SCOPES:
        raise StrategyError(f"{MAC_VARIABLE} must be one of {', '.join(MAC_SCOPES)} "
                            f"({MAC_VARIABLE}: {value!r})")
    return value


def rank_0_share(rank: int, environ: Optional[Mapping[str, str]] = None) -> Tuple[bytes, str]:
    """What this rank puts in the address allgather for the seal: rank 0's new secret and MAC scope, else nothing.

    Every rank reads ``DUALFRAME_PIPELINE_MAC`` (a bad value is refused on every rank before the
    allgather); rank 0's scope is the pipeline's.
    """
    scope = mac_scope(environ)
    return (new_secret(), scope) if rank == 0 else (b"", "")


def job_seal(entries: Sequence[Sequence[Any]], rank: int) -> "MessageSeal":
    """This rank's ``MessageSeal``, from rank 0's ``rank_0_share`` (the last item of its allgather entry)."""
    secret, scope = entries[0][-1]
    if len(secret) != SECRET_BYTES or scope not in MAC_SCOPES:
        raise StrategyError(f"rank 0 shared a pipeline secret of {len(secret)} bytes and MAC scope {scope!r} where "
                            f"{SECRET_BYTES} bytes and one of {', '.join(MAC_SCOPES)} were expected "
                            "(every rank must run the same dualframe)")
    return MessageSeal(bytes(secret), rank, len(entries), whole=scope == "message")


def _bytes(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")


class MessageSeal:
    """Seals this rank's pipeline messages and opens the ones it receives, with the pipeline's secret.

    Args:
        secret: the pipeline's ``SECRET_BYTES`` (rank 0's ``new_secret``, shared by the allgather).
        rank: this process's rank; ``size``: how many ranks the job has.
        whole: the MAC covers the message's bytes too (``DUALFRAME_PIPELINE_MAC=message``), not only its header.

    Example:
        >>> key = new_secret()
        >>> sender, receiver = MessageSeal(key, 0, 2), MessageSeal(key, 1, 2)
        >>> head = sender.seal(dest=1, tag=6, body=b"abc")
        >>> receiver.open([head, b"abc"]), receiver.dropped  # a second open of it: None, dropped 1 (a replay)
        ((0, 6, b'abc'), 0)
    """

    def __init__(self, secret: bytes, rank: int, size: int, whole: bool = False) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a pipeline secret has {SECRET_BYTES} bytes (secret: {len(secret)} bytes)")
        self.secret, self.rank, self.size, self.whole = bytes(secret), rank, size, whole
        self._sent: Dict[int, int] = collections.defaultdict(int)  # receiver -> last counter sent
        self._heard: Dict[int, int] = collections.defaultdict(int)  # sender -> last counter opened
        self.reasons: Dict[str, int] = collections.Counter()
        self._warned = False

    @property
    def dropped(self) -> int:
        """How many received messages were dropped (not from this pipeline's ranks, or replayed)."""
        return sum(self.reasons.values())

    def _mac(self, fields: bytes, body: memoryview) -> bytes:
        mac = hmac.new(self.secret, fields, _DIGEST)
        if self.whole:
            mac.update(body)
        return mac.digest()

    def seal(self, dest: int, tag: int, body: Any) -> bytes:
        """The first frame of a message to rank ``dest`` whose second frame is ``body`` (bytes-like)."""
        data = _bytes(body)
        self._sent[dest] += 1
        fields = _FIELDS.pack(self.rank, dest, tag, self._sent[dest], data.nbytes)
        return fields + self._mac(fields, data)

    def open(self, frames: Sequence[Any]) -> Optional[Tuple[int, int, Any]]:
        """(sender, tag, body) of a received message when it is a genuine new one of this pipeline, else None (counted)."""
        reason = self._refusal(frames)
        if reason:
            self._drop(reason)
            return None
        sender, _, tag, counter, _ = _FIELDS.unpack_from(_bytes(frames[0]))
        self._heard[sender] = counter
        return sender, tag, frames[1]

    def _refusal(self, frames: Sequence[Any]) -> str:
        """Why ``frames`` are not a genuine new message to this rank ("" when they are)."""
        if len(frames) != 2:
            return "not two frames"
        head, data = _bytes(frames[0]), _bytes(frames[1])
        if head.nbytes != HEAD_BYTES:
            return "a header of another size"
        fields = head[:_FIELDS.size].tobytes()
        sender, receiver, _, counter, length = _FIELDS.unpack(fields)
        if length != data.nbytes:  # before the MAC: a stranger's wrong sizes cost no hashing
            return "a body of another length than its header says"
        if not hmac.compare_digest(self._mac(fields, data), head[_FIELDS.size:].tobytes()):
            return "a MAC that does not match"
        if receiver != self.rank or not 0 <= sender < self.size:
            return "another rank's message"
        if counter <= self._heard[sender]:
            return "a replayed message"
        return ""

    def _drop(self, reason: str) -> None:
        self.reasons[reason] += 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"rank {self.rank}'s pipeline socket dropped a message that is not from this job's ranks "
                          f"({reason}); something else is sending to it. Dropped messages are counted in "
                          "the pipeline's direct.dropped; this warning is not repeated", RuntimeWarning, stacklevel=4)

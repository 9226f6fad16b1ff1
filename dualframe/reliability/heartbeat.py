"""The job's heartbeat: every rank tells the others twice a second that it is alive, so survivors name a lost one.

Started by ``hvd.init()`` under a launcher (``start``): each rank binds one UDP socket on the
address the pipelines use (``zmq_auth.listen_address``: the loopback on one host, never every
interface), and one allgather shares every rank's ``Peer`` (rank, host, addresses, pid, port) and
rank 0's secret. A daemon thread then sends each other rank a beat every ``INTERVAL_S`` and reads
theirs; every datagram carries an HMAC-SHA256 under the secret and a counter (anything else is
dropped). A rank that ends says so first (``bye``: finished, failed, stopped). From that the
survivors know, without any error text:

* a rank **silent** for ``DUALFRAME_PEER_TIMEOUT`` seconds (default 15): its host or the link to
  it is down, or the process is stopped; the survivors print ``lost rank 1 (host node2, pid 4242):
  no heartbeat for 15 s`` (a notice: the job is ended by Gloo's timeout, the launcher, or the stall
  watchdog);
* a rank whose **port refuses** the beats (ICMP port unreachable): its process ended without a word
  (SIGKILL, the OOM killer);
* a rank that **failed**: its own exception, named in its ``bye``.

``DUALFRAME_PEER_TIMEOUT=0`` turns the heartbeat off; elastic jobs (``HOROVOD_ELASTIC=1``, where
ranks join at other times) and ``init(comm=...)`` run without it.
"""
from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from dualframe.errors import StrategyError
from dualframe.pipeline.zmq_auth import listen_address
from dualframe.reliability.peers import Peer, PeerTable, this_peer

#: Seconds of silence before the survivors print that a rank is lost; 0 turns the heartbeat off.
TIMEOUT_VARIABLE = "DUALFRAME_PEER_TIMEOUT"
DEFAULT_TIMEOUT_S = 15.0
#: Seconds between two beats to each peer.
INTERVAL_S = 0.5
#: A datagram: sender rank, counter, kind (little-endian), then a UTF-8 text, then the MAC.
_FIELDS = struct.Struct("<qQB")
BEAT, FINISHED, FAILED, STOPPED = 0, 1, 2, 3
_KINDS = {"finished": FINISHED, "failed": FAILED, "stopped": STOPPED}
_DIGEST_BYTES = hashlib.sha256().digest_size
_MAX_TEXT = 400


def peer_timeout(environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds of silence before a rank is called lost, from ``DUALFRAME_PEER_TIMEOUT`` (default 15; 0 = off).

    Example:
        >>> peer_timeout({}), peer_timeout({"DUALFRAME_PEER_TIMEOUT": "4"})
        (15.0, 4.0)

    Raises:
        StrategyError: not a number >= 0.
    """
    return seconds_variable(TIMEOUT_VARIABLE, DEFAULT_TIMEOUT_S, environ)


def seconds_variable(name: str, default: float, environ: Optional[Mapping[str, str]] = None) -> float:
    """The number of seconds >= 0 in the variable ``name``, ``default`` when unset or blank.

    Raises:
        StrategyError: not a number >= 0.
    """
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise StrategyError(f"{name} must be a number of seconds >= 0 ({name}={raw!r})")
    return value


class Seal:
    """The heartbeat's datagrams: sealed with an HMAC-SHA256 under the job's secret, opened once each.

    Example:
        >>> key = bytes(32)
        >>> Seal(key, 1).open(Seal(key, 0).seal(BEAT, "")), Seal(key, 1).open(b"junk")
        ((0, 0, ''), None)
    """

    def __init__(self, secret: bytes, rank: int) -> None:
        self.secret, self.rank = secret, rank
        self._sent = 0
        self._last: Dict[int, int] = {}

    def seal(self, kind: int, text: str) -> bytes:
        """A datagram of ``kind`` from this rank, with ``text`` (cut to 400 bytes)."""
        body = _FIELDS.pack(self.rank, self._sent, kind) + text.encode()[:_MAX_TEXT]
        self._sent += 1
        return body + hmac.new(self.secret, body, "sha256").digest()

    def open(self, data: bytes) -> Optional[Tuple[int, int, str]]:
        """(sender, kind, text) of a genuine, new datagram; None for anything else."""
        if len(data) < _FIELDS.size + _DIGEST_BYTES:
            return None
        body, mac = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self.secret, body, "sha256").digest()):
            return None
        sender, counter, kind = _FIELDS.unpack_from(body)
        if counter < self._last.get(sender, 0) or sender == self.rank:
            return None
        self._last[sender] = counter + 1
        return sender, kind, body[_FIELDS.size:].decode(errors="replace")


class Heartbeat:
    """Beats to every other rank of ``table`` and keeps what it heard: who is silent, gone, or said why it left.

    Example:
        >>> beat = Heartbeat(table, Seal(secret, table.me), sock, write=print)    # doctest: +SKIP
        >>> beat.start(); beat.lost(min_silence=1.5)                              # doctest: +SKIP
        [(1, 'no heartbeat for 31.0 s')]

    Args:
        table: every rank's Peer (each with its heartbeat's ``reach`` and ``port``).
        seal: this rank's Seal.
        sock: this rank's bound UDP socket.
        notice_after: seconds of silence before ``write`` is told a rank is lost.
        write: takes one line (``lost rank 1 (host b, pid 22): ...``) for each rank found lost.
    """

    def __init__(self, table: PeerTable, seal: Seal, sock: socket.socket, notice_after: float = DEFAULT_TIMEOUT_S,
                 write: Optional[Callable[[str], None]] = None) -> None:
        self.table, self.seal, self.sock, self.notice_after = table, seal, sock, notice_after
        sock.settimeout(INTERVAL_S / 2)
        self.write = write or (lambda line: None)
        now = time.monotonic()
        beating = [r for r in table.others() if table.peers[r].port]  # port 0: that rank's heartbeat is off
        self.heard: Dict[int, float] = {r: now for r in beating}
        self.left: Dict[int, Tuple[int, str]] = {}  # rank -> (kind, its text)
        self.refused: Set[int] = set()
        self._noticed: Set[int] = set()
        self._lock = threading.Lock()
        self._senders: Dict[int, socket.socket] = {}
        for r in beating:
            peer = table.peers[r]
            sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sender.connect((peer.reach, peer.port))  # connected: a closed port comes back as ConnectionRefusedError
            self._senders[r] = sender
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dualframe-heartbeat", daemon=True)

    def start(self) -> None:
        """Start the beating thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (the sockets stay open until the process ends)."""
        self._stop.set()

    def send_all(self, kind: int = BEAT, text: str = "") -> None:
        """One datagram to every other rank that has not left; a refusal marks the rank gone."""
        for r, sender in list(self._senders.items()):
            if r in self.left:
                continue
            with self._lock:
                data = self.seal.seal(kind, text)
            try:
                sender.send(data)
            except ConnectionRefusedError:
                self.refused.add(r)
            except OSError:
                pass  # no route (a cut link): silence tells

    def bye(self, how: str, text: str = "") -> None:
        """Tell every other rank this one ends: ``how`` is finished, failed or stopped."""
        self.send_all(_KINDS[how], text)

    def receive(self, data: bytes) -> None:
        """Take one datagram (dropped unless genuine and new)."""
        with self._lock:
            opened = self.seal.open(data)
        if opened is None:
            return
        sender, kind, text = opened
        if sender in self.heard:
            self.heard[sender] = time.monotonic()
            if kind != BEAT:
                self.left[sender] = (kind, text)
            if kind == FAILED:  # at once: the launcher may end this rank a moment after the failed one exits
                self._notice(self.heard[sender])

    def lost(self, min_silence: float, now: Optional[float] = None) -> List[Tuple[int, str]]:
        """The ranks lost as far as heard: (rank, why), failed ones first; none that finished or stopped."""
        now = time.monotonic() if now is None else now
        failed = [(r, f"it failed: {text[len('failed: '):] if text.startswith('failed: ') else text}")
                  for r, (kind, text) in sorted(self.left.items()) if kind == FAILED]
        gone = [(r, "its process ended (its heartbeat port refuses)") for r in sorted(self.refused)
                if r not in self.left]
        silent = [(r, f"no heartbeat for {now - t:.1f} s") for r, t in sorted(self.heard.items())
                  if r not in self.left and r not in self.refused and now - t >= min_silence]
        return failed + gone + silent

    def ended(self) -> List[Tuple[int, str]]:
        """The ranks that said they finished their script or stopped: (rank, how)."""
        names = {FINISHED: "it had finished its script", STOPPED: "it stopped"}
        return [(r, names[kind]) for r, (kind, _) in sorted(self.left.items()) if kind in names]

    def describe(self, found: Sequence[Tuple[int, str]]) -> str:
        """``lost rank 1 (host b, pid 22): no heartbeat for 31.0 s; ...``."""
        return "; ".join(f"lost {self.table.peers[r].label()}: {why}" for r, why in found)

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self.send_all()
                next_beat = now + INTERVAL_S
                self._notice(now)
            try:
                self.receive(self.sock.recv(2048))
            except (socket.timeout, ConnectionRefusedError):
                pass
            except OSError:
                time.sleep(INTERVAL_S / 2)

    def _notice(self, now: float) -> None:
        fresh = [(r, why) for r, why in self.lost(self.notice_after, now) if r not in self._noticed]
        if fresh:
            self._noticed.update(r for r, _ in fresh)
            self.write(self.describe(fresh))


def start(gather: Callable[[bytes, str], List[bytes]], rank: int, write: Callable[[str], None],
          on: bool = True, environ: Optional[Mapping[str, str]] = None) -> Tuple[PeerTable, Optional[Heartbeat]]:
    """Share every rank's Peer (one allgather, on every rank alike) and start this rank's heartbeat when ``on``.

    Every rank of the job must call it right after Horovod starts, whatever ``on`` says: a rank whose
    heartbeat is off (``on`` False, or ``DUALFRAME_PEER_TIMEOUT=0`` here) sends port 0 and no one waits
    for its beats.

    Args:
        gather: every rank's bytes, in rank order (the adapter's ``gather_bytes``).
        rank: this rank.
        write: takes each line naming lost ranks.
        on: False where this rank's failure hooks are off.
        environ: where ``DUALFRAME_PEER_TIMEOUT`` and the listening address are read; ``os.environ`` by default.

    Returns:
        The job's PeerTable, and the running Heartbeat (None where it is off).
    """
    timeout = peer_timeout(environ)
    on = on and timeout > 0
    sock, address = None, ""
    if on:
        address = listen_address(environ)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((address, 0))
    mine = {"peer": this_peer(rank, sock.getsockname()[1] if sock else 0, address).to_json(),
            "secret": secrets.token_bytes(32).hex() if rank == 0 else ""}
    entries = [json.loads(raw.decode()) for raw in gather(json.dumps(mine).encode(), "dualframe.peers")]
    table = PeerTable([Peer.from_json(entry["peer"]) for entry in entries], rank)
    if sock is None:
        return table, None
    heartbeat = Heartbeat(table, Seal(bytes.fromhex(entries[0]["secret"]), rank), sock, timeout, write)
    heartbeat.start()
    atexit.register(_finished, heartbeat, os.getpid())
    return table, heartbeat


def _finished(heartbeat: Heartbeat, pid: int) -> None:
    # A rank that returns from its script says so, so the others do not call it lost (not in forked children).
    if os.getpid() == pid:
        heartbeat.stop()
        heartbeat.bye("finished")

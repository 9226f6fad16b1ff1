"""Who every rank of the job is (rank, host, addresses, pid), and which of them an error's text names.

Gathered once at ``hvd.init()`` (one small allgather), so that when a peer is lost the survivors can
say ``lost rank 1 (host node2, pid 4242)`` instead of Gloo's ``Timed out waiting 30000ms`` or
Horovod's ``Horovod has been shut down``. ``PeerTable.named_in`` maps what an error names (Gloo's
``[10.0.0.2]:40346``, a ZeroMQ endpoint ``tcp://10.0.0.2:5555``, Open MPI's ``process rank 1 ... on
node node2``, a pipeline's ``from rank 1``) to ranks; ``dualframe.reliability.heartbeat`` finds the
lost ranks where the error names nothing.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from dualframe.errors import StrategyError

#: An IPv4 address, alone or as Gloo (``[a.b.c.d]:port``) and ZeroMQ (``tcp://a.b.c.d:port``) write it.
_ADDRESS = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")
#: Texts that name a peer's rank: Open MPI's, Slurm's, the pipelines' (``from rank 1``, ``rank 1 closed ...``).
_RANK_PATTERNS = (
    re.compile(r"process rank (\d+)"),
    re.compile(r"\btask (\d+)\b"),
    re.compile(r"\b(?:from|to) rank (\d+)"),
    re.compile(r"\brank (\d+) (?:closed|left|is gone|failed)"),
    re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]"),
)
#: Texts that name a peer's host: Open MPI (``on node dfn2``, ``on host dfn2``), Slurm (``Node failure on dfn2``).
_HOST_PATTERNS = (re.compile(r"\bon (?:node|host) ([\w.-]+)"), re.compile(r"Node failure on ([\w.-]+)"))


@dataclass(frozen=True)
class Peer:
    """One rank of the job as the others see it.

    Example:
        >>> Peer(1, "node2", ("10.0.0.2",), 4242).label()
        'rank 1 (host node2, pid 4242)'

    Args:
        rank: the rank in the job.
        host: its host name.
        addresses: the IPv4 addresses of its host (loopback left out).
        pid: its process id.
        port: its heartbeat's UDP port (0: none).
        reach: the address its heartbeat listens on ("": none).
    """

    rank: int
    host: str
    addresses: Tuple[str, ...]
    pid: int
    port: int = 0
    reach: str = ""

    def label(self) -> str:
        """``rank 1 (host node2, pid 4242)``."""
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"

    def to_json(self) -> Dict[str, Any]:
        """The fields as JSON values, for the allgather."""
        return {"rank": self.rank, "host": self.host, "addresses": list(self.addresses), "pid": self.pid,
                "port": self.port, "reach": self.reach}

    @staticmethod
    def from_json(entry: Mapping[str, Any]) -> "Peer":
        """The Peer a rank sent; a malformed entry is refused with ``StrategyError``."""
        try:
            return Peer(int(entry["rank"]), str(entry["host"]), tuple(str(a) for a in entry["addresses"]),
                        int(entry["pid"]), int(entry.get("port", 0)), str(entry.get("reach", "")))
        except (KeyError, TypeError, ValueError) as error:
            raise StrategyError(f"a rank sent a malformed peer entry ({entry!r}): every rank must run the same "
                                "dualframe") from error


def host_addresses() -> Tuple[str, ...]:
    """This host's IPv4 addresses, loopback left out (psutil where present, else the host name resolved)."""
    found: List[str] = []
    try:
        import psutil

        for entries in psutil.net_if_addrs().values():
            found += [str(e.address) for e in entries if e.family == socket.AF_INET]
    except ImportError:
        try:
            found = socket.gethostbyname_ex(socket.gethostname())[2]
        except OSError:
            found = []
    return tuple(sorted({a for a in found if not a.startswith("127.")}))


def this_peer(rank: int, port: int = 0, reach: str = "") -> Peer:
    """This process as a Peer: its host name, addresses and pid, and where its heartbeat listens."""
    return Peer(rank, socket.gethostname(), host_addresses(), os.getpid(), port, reach)


class PeerTable:
    """Every rank's Peer, and the ranks an error's text names.

    Example:
        >>> table = PeerTable([Peer(0, "a", ("10.0.0.1",), 11), Peer(1, "b", ("10.0.0.2",), 22)], me=0)
        >>> table.named_in("Connection closed by peer [10.0.0.2]:40346")
        [1]
        >>> table.describe([1])
        'rank 1 (host b, pid 22)'

    Args:
        peers: one Peer per rank, in rank order.
        me: this process's rank (never named as lost).
    """

    def __init__(self, peers: Sequence[Peer], me: int) -> None:
        if [p.rank for p in peers] != list(range(len(peers))):
            raise StrategyError(f"peers must be given in rank order 0..{len(peers) - 1} "
                                f"(ranks: {[p.rank for p in peers]})")
        if not 0 <= me < len(peers):
            raise StrategyError(f"me must be a rank of the table (me: {me}, ranks: {len(peers)})")
        self.peers, self.me = list(peers), me

    @property
    def size(self) -> int:
        """Ranks in the job."""
        return len(self.peers)

    def others(self) -> List[int]:
        """Every rank but this one."""
        return [p.rank for p in self.peers if p.rank != self.me]

    def on_address(self, address: str) -> List[int]:
        """The other ranks whose host has ``address``."""
        return [p.rank for p in self.peers if address in p.addresses and p.rank != self.me]

    def on_host(self, host: str) -> List[int]:
        """The other ranks on the host named ``host`` (short names match their long form)."""
        short = host.split(".")[0]
        return [p.rank for p in self.peers if p.rank != self.me and p.host.split(".")[0] == short]

    def named_in(self, text: str) -> List[int]:
        """The other ranks ``text`` names, by rank, host or address (sorted; [] when it names none)."""
        ranks = {int(m.group(1)) for pattern in _RANK_PATTERNS for m in pattern.finditer(text)}
        if ranks & set(range(self.size)):  # a text naming a rank names it alone: its host may hold others
            return sorted(r for r in ranks if 0 <= r < self.size and r != self.me)
        for pattern in _HOST_PATTERNS:
            ranks.update(r for m in pattern.finditer(text) for r in self.on_host(m.group(1)))
        for match in _ADDRESS.finditer(text):
            ranks.update(self.on_address(match.group(1)))
        return sorted(ranks)

    def describe(self, ranks: Sequence[int]) -> str:
        """``rank 1 (host b, pid 22), rank 2 (...)`` for ``ranks``."""
        return ", ".join(self.peers[r].label() for r in ranks)

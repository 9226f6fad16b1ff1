"""The job's hosts before launch, reached through the launcher's own remote agent: who answers, their interfaces, the one they share.

``mpirun`` and ``horovodrun`` reach other hosts with ssh (Open MPI: its ``plm_rsh_agent``). When one
cannot be reached, Open MPI says only "ORTE was unable to reliably start one or more daemons" and
names no host; horovodrun retries its ssh check 5 times. Asking every host once, in parallel, with
the same agent and a short timeout names the host and ssh's reason within seconds, and the same
answer lists the host's interfaces, from which the one the hosts share is chosen.
"""
from __future__ import annotations

import ipaddress
import shlex
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from dualframe.errors import DualframeError

#: Seconds ssh waits to connect; a host on the network answers well within it.
CONNECT_TIMEOUT_S = 5
#: The line that proves the command ran there, then the host's addresses (``ip`` may be missing: no list).
_MARKER = "dualframe-reached"
REMOTE_COMMAND = f"echo {_MARKER}; ip -o addr show 2>/dev/null"
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class HostUnreachableError(DualframeError, ConnectionError):
    """One or more of the job's hosts did not answer through the launcher's remote agent."""


@dataclass(frozen=True)
class Interface:
    """One address of a network interface, e.g. ``Interface("eth0", "10.203.7.1/24")``."""

    name: str
    address: str

    @property
    def network(self) -> str:
        """The subnet the address is in, e.g. ``10.203.7.0/24``."""
        return str(ipaddress.ip_interface(self.address).network)

    @property
    def usable(self) -> bool:
        """False for loopback and link-local addresses, which never join two hosts."""
        ip = ipaddress.ip_interface(self.address).ip
        return not (ip.is_loopback or ip.is_link_local)


@dataclass(frozen=True)
class HostReport:
    """What one host answered: whether it was reached, why not, and its interfaces.

    Example:
        >>> report = HostReport("dfn2", True, interfaces=(Interface("eth0", "10.203.7.2/24"),))
        >>> report.describe()
        'eth0 10.203.7.2/24'
    """

    host: str
    reachable: bool
    error: str = ""
    interfaces: Tuple[Interface, ...] = ()
    local: bool = False

    def describe(self) -> str:
        """Its interfaces as ``name address`` pairs, or why it was not reached."""
        if not self.reachable:
            return f"UNREACHABLE: {self.error}"
        return ", ".join(f"{i.name} {i.address}" for i in self.interfaces) or "interfaces unknown (no `ip` there)"


@dataclass(frozen=True)
class Choice:
    """The interfaces the hosts share: ``interfaces`` to pass (empty when there is no single one), and why."""

    interfaces: Tuple[str, ...]
    reason: str
    networks: Tuple[str, ...] = field(default=())


def is_local(host: str) -> bool:
    """True when ``host`` names this machine (the launchers start its ranks without ssh)."""
    return host in _LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def parse_addresses(text: str) -> Tuple[Interface, ...]:
    """Interfaces from ``ip -o addr show`` lines (``2: eth0    inet 10.0.0.1/24 brd ...``).

    Example:
        >>> parse_addresses("2: eth0    inet 10.0.0.1/24 brd 10.0.0.255 scope global eth0")
        (Interface(name='eth0', address='10.0.0.1/24'),)
    """
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("inet", "inet6"):
            found.append(Interface(fields[1].split("@")[0].rstrip(":"), fields[3]))
    return tuple(found)


def option_value(args: Sequence[str], names: Sequence[str]) -> Optional[str]:
    """The value of ``--name value`` or ``--name=value`` in ``args`` (the last one given)."""
    value = None
    for at, arg in enumerate(args):
        name, equals, inline = arg.partition("=")
        if name in names:
            value = inline if equals else (args[at + 1] if at + 1 < len(args) else None)
    return value


def _mca(args: Sequence[str], names: Sequence[str]) -> Optional[str]:
    """The value of ``--mca NAME VALUE`` (or ``-mca``) in mpirun's arguments."""
    value = None
    for at, arg in enumerate(args[:-2]):
        if arg in ("--mca", "-mca") and args[at + 1] in names:
            value = args[at + 2]
    return value


def remote_agent(launcher: str, launcher_args: Sequence[str], environ: Mapping[str, str],
                 find: Callable[[str], Optional[str]]) -> List[str]:
    """The command the launcher reaches another host with, ready for ``[*agent, host, command]``.

    mpirun: Open MPI's ``plm_rsh_agent`` (``--mca`` or ``OMPI_MCA_plm_rsh_agent``; ``ssh : rsh`` by
    default, the first found) and ``plm_rsh_args``. horovodrun: ssh, with its ``--ssh-port`` and
    ``--ssh-identity-file``. ssh gets ``BatchMode`` (a password prompt would hang) and a connect timeout.

    Example:
        >>> remote_agent("horovodrun", ["-p", "2222"], {}, lambda name: "/usr/bin/" + name)[-2:]
        ['-p', '2222']
    """
    if launcher == "mpirun":
        agent = (_mca(launcher_args, ("plm_rsh_agent", "orte_rsh_agent"))
                 or environ.get("OMPI_MCA_plm_rsh_agent") or "ssh : rsh")
        extra = _mca(launcher_args, ("plm_rsh_args",)) or environ.get("OMPI_MCA_plm_rsh_args", "")
        for choice in agent.split(":"):
            words = shlex.split(choice)
            if words and find(words[0]):
                return words + _ssh_options(words[0]) + shlex.split(extra)
        raise HostUnreachableError(f"Open MPI's remote agent is not on PATH (plm_rsh_agent: {agent!r}); "
                                   "install ssh (apt-get install openssh-client) or name yours with "
                                   "--launcher-arg=--mca --launcher-arg=plm_rsh_agent --launcher-arg=AGENT")
    command = ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no", *_ssh_options("ssh")]
    port = option_value(launcher_args, ("-p", "--ssh-port"))
    identity = option_value(launcher_args, ("-i", "--ssh-identity-file"))
    return command + (["-i", identity] if identity else []) + (["-p", port] if port else [])


def _ssh_options(program: str) -> List[str]:
    if program.rsplit("/", 1)[-1] != "ssh":
        return []
    return ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]


def probe_host(host: str, agent: Sequence[str], timeout_s: float = CONNECT_TIMEOUT_S + 5) -> HostReport:
    """Run ``REMOTE_COMMAND`` on ``host`` (here without the agent when it is this machine)."""
    local = is_local(host)
    command = ["sh", "-c", REMOTE_COMMAND] if local else [*agent, host, REMOTE_COMMAND]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return HostReport(host, False, f"no answer within {timeout_s:.0f} s ({shlex.join(command[:1])})", local=local)
    except OSError as error:
        return HostReport(host, False, f"{command[0]}: {error.strerror}", local=local)
    if _MARKER not in result.stdout.split("\n", 1)[0]:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        return HostReport(host, False, lines[-1] if lines else f"{command[0]} exited {result.returncode}", local=local)
    return HostReport(host, True, interfaces=parse_addresses(result.stdout), local=local)


def probe(hosts: Sequence[str], agent: Sequence[str], timeout_s: float = CONNECT_TIMEOUT_S + 5) -> List[HostReport]:
    """``probe_host`` on every host at once; the reports in the hosts' order."""
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(pool.map(lambda host: probe_host(host, agent, timeout_s), hosts))


def unreachable_message(reports: Sequence[HostReport], launcher: str) -> Optional[str]:
    """One message naming every host that did not answer and why, or None when all did."""
    lost = [report for report in reports if not report.reachable]
    if not lost:
        return None
    names = ", ".join(report.host for report in lost)
    reasons = "; ".join(f"{report.host}: {report.error}" for report in lost)
    return (f"cannot reach {names} through {launcher}'s remote agent ({reasons}); check the host name, that it is "
            f"up and on the network, and that `ssh {lost[0].host} true` works without a password, "
            "or leave it out of -H/--hostfile")


def choose_interfaces(reports: Sequence[HostReport]) -> Choice:
    """The interface(s) on the one subnet every host has an address in, else none and why.

    Example:
        >>> a = HostReport("a", True, interfaces=(Interface("lo", "127.0.0.1/8"), Interface("eth0", "10.0.0.1/24")))
        >>> b = HostReport("b", True, interfaces=(Interface("eth0", "10.0.0.2/24"),))
        >>> choose_interfaces([a, b]).interfaces
        ('eth0',)
    """
    if reports and all(report.local for report in reports):
        return Choice(("lo",), "every host is this one", ("127.0.0.0/8",))
    unknown = [report.host for report in reports if not report.reachable or not report.interfaces]
    if unknown:
        return Choice((), f"the interfaces of {', '.join(unknown)} are unknown; pass --network-interfaces")
    subnets: Dict[str, set] = {}
    for report in reports:
        for interface in report.interfaces:
            if interface.usable:
                subnets.setdefault(interface.network, set()).add(report.host)
    shared = sorted(net for net, hosts in subnets.items() if len(hosts) == len(reports))
    names = {net: sorted({i.name for r in reports for i in r.interfaces if i.usable and i.network == net})
             for net in shared}
    if len(shared) == 1:
        return Choice(tuple(names[shared[0]]), f"{shared[0]} is the one subnet every host is on "
                      f"({', '.join(names[shared[0]])})", tuple(shared))
    if not shared:
        return Choice((), "the hosts share no subnet; pass --network-interfaces naming the interface that joins them")
    listed = ", ".join(f"{net} ({', '.join(names[net])})" for net in shared)
    return Choice((), f"the hosts share {len(shared)} subnets: {listed}; the launcher chooses unless you pass "
                      "--network-interfaces", tuple(shared))

"""``dualframe run``: start a script on N processes with the right launcher and thread settings.

The launcher is chosen in this order unless one is named: ``srun`` inside a SLURM allocation,
``horovodrun`` (Gloo by default) when installed, else Open MPI's ``mpirun``. The command lines come
from ``dualframe.launch.commands``; this module adds the choice, the hosts, the network interfaces, and
the thread variables that give each process its share of the cores (``OMP_NUM_THREADS`` ...), so N
processes do not oversubscribe. Before starting on other hosts, ``main`` asks each of them through the
launcher's remote agent (``dualframe.launch.remote``): one that does not answer is refused by name, and
the interface the hosts share is passed on when there is exactly one.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from dualframe.errors import DualframeError
from dualframe.launch.commands import THREAD_VARIABLES, find_executable, horovodrun_command, mpirun_command, srun_command
from dualframe.launch.commands import thread_env
from dualframe.launch import remote, watch

LAUNCHERS = ("auto", "horovodrun", "mpirun", "srun")
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
#: Variables mpirun passes on with -x besides the thread settings, when they are set.
_PASSED_ON = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL")
_INTERFACE_NAMES = re.compile(r"[A-Za-z0-9_.:@-]+(,[A-Za-z0-9_.:@-]+)*")


class LaunchError(DualframeError, ValueError):
    """The job cannot be started as asked; the message names the rule and the fix."""


@dataclass(frozen=True)
class Launch:
    """A resolved launch: the command, the variables it adds to the environment, and why.

    Example:
        >>> job = plan_launch(2, ["train.py"], launcher="mpirun", environ={}, cores=2,
        ...                   find=lambda name: "/usr/bin/" + name, python="python")
        >>> job.command[-2:], job.env["OMP_NUM_THREADS"]
        (['python', 'train.py'], '1')
    """

    launcher: str
    command: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def shell(self) -> str:
        """The command as one shell line, the added variables first: what ``--dry-run`` prints."""
        assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(self.env.items())]
        return " ".join(assignments + [shlex.join(self.command)])


def parse_hosts(hosts: Optional[str] = None, hostfile: Optional[str] = None) -> List[Tuple[str, int]]:
    """(host, slots) pairs from ``-H a:2,b:2`` or a hostfile (``a slots=2`` or ``a:2`` per line)."""
    entries: List[str] = []
    if hostfile:
        try:
            with open(hostfile) as handle:
                entries = [line.split("#")[0].strip() for line in handle]
        except OSError as error:
            raise LaunchError(f"cannot read the hostfile {hostfile!r} ({error.strerror})") from None
    elif hosts:
        entries = hosts.split(",")
    parsed = []
    for entry in filter(None, entries):
        match = re.fullmatch(r"([^\s:]+)(?:\s*:\s*(\d+)|\s+slots\s*=\s*(\d+))?(?:\s+.*)?", entry)
        if not match:
            raise LaunchError(f"cannot read host {entry!r}; write host:slots or 'host slots=N'")
        parsed.append((match.group(1), int(match.group(2) or match.group(3) or 1)))
    return parsed


def _is_local(hosts: Sequence[Tuple[str, int]]) -> bool:
    names = set(_LOCAL_NAMES) | {socket.gethostname()}
    return all(host in names for host, _ in hosts)


def _given(args: Sequence[str], name: str) -> bool:
    """True when the launcher arguments already hold ``name`` (``--name value`` or ``--name=value``)."""
    return any(arg.split("=")[0].startswith(name) for arg in args)


def _check_interfaces(network_interfaces: Optional[str]) -> None:
    if network_interfaces is not None and not _INTERFACE_NAMES.fullmatch(network_interfaces):
        raise LaunchError(f"--network-interfaces takes interface names separated by commas, e.g. eth0 or ib0,eth0 "
                          f"(network_interfaces: {network_interfaces!r}); `dualframe doctor -H ...` lists each host's")


def choose_launcher(requested: str, environ: Mapping[str, str], find: Callable[[str], Optional[str]]) -> str:
    """The launcher to use: ``requested`` if available, else srun (in SLURM) > horovodrun > mpirun."""
    if requested not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {requested!r}; choose one of {', '.join(LAUNCHERS)}")
    if requested != "auto":
        if find(requested) is None:
            raise LaunchError(f"{requested} is not on PATH; install it (bash scripts/bootstrap.sh) or use --launcher auto")
        return requested
    in_allocation = "SLURM_JOB_ID" in environ and find("srun") is not None
    for name in (["srun"] if in_allocation else []) + ["horovodrun", "mpirun"]:
        if find(name) is not None:
            return name
    raise LaunchError("no launcher found: neither horovodrun nor mpirun is on PATH; run `bash scripts/bootstrap.sh`")


def _program(program: Sequence[str], python: str) -> List[str]:
    if not program:
        raise LaunchError("nothing to run: give a script, e.g. `dualframe run -np 2 train.py`")
    return [python, *program] if program[0].endswith(".py") else list(program)


def _threads(launcher: str, np: int, hosts: Sequence[Tuple[str, int]], environ: Mapping[str, str],
             cores: int, threads: Optional[int]) -> Dict[str, str]:
    if threads is not None:
        return thread_env(1, cores=threads)
    if launcher == "srun" and environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return thread_env(1, cores=int(environ["SLURM_CPUS_PER_TASK"]))
    per_node = max(slots for _, slots in hosts) if hosts else np
    return thread_env(min(np, per_node) if hosts else np, cores=cores)


def plan_launch(np: int, program: Sequence[str], launcher: str = "auto", hosts: Optional[str] = None,
                hostfile: Optional[str] = None, gloo: bool = True, threads: Optional[int] = None,
                launcher_args: Sequence[str] = (), network_interfaces: Optional[str] = None,
                environ: Optional[Mapping[str, str]] = None,
                cores: Optional[int] = None, find: Optional[Callable[[str], Optional[str]]] = None,
                python: Optional[str] = None) -> Launch:
    """Resolve a launch without starting anything (see the module docstring for the choice).

    Args:
        np: processes in the job.
        program: the script and its arguments (a ``.py`` script runs under this Python).
        launcher: ``auto``, ``horovodrun``, ``mpirun`` or ``srun``.
        hosts, hostfile: where to run (``-H a:2,b:2`` or a file); this host alone by default.
        gloo: horovodrun's controller: Gloo (default) or MPI.
        threads: threads per process; default: the node's cores shared by its processes.
        launcher_args: more arguments for the launcher itself (e.g. ``--mpi=pmix`` for srun).
        network_interfaces: the interfaces between the hosts (``eth0``, ``ib0,eth0``): horovodrun's
            ``--network-interfaces``, mpirun's ``btl_tcp_if_include`` and ``oob_tcp_if_include``, srun's
            ``OMPI_MCA_btl_tcp_if_include``, and ``NCCL_SOCKET_IFNAME`` under mpirun and srun.
        environ, cores, find, python: the surroundings, for tests (default: this process's).

    Raises:
        LaunchError: bad ``np``, hosts, interfaces or launcher, or hosts given to srun.
    """
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise LaunchError(f"-np must be an int >= 1 (np: {np!r})")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise LaunchError(f"--threads must be an int >= 1 (threads: {threads!r})")
    if hosts and hostfile:
        raise LaunchError(f"give -H or --hostfile, not both (-H {hosts}, --hostfile {hostfile})")
    _check_interfaces(network_interfaces)
    env = os.environ if environ is None else environ
    python = python or sys.executable
    find = find or (lambda name: _beside(name, python, env))
    chosen = choose_launcher(launcher, env, find)
    host_list = parse_hosts(hosts, hostfile)
    command = _program(program, python)
    thread_vars = _threads(chosen, np, host_list, env, cores or os.cpu_count() or 1, threads)
    script = remote.option_value(launcher_args, ("--host-discovery-script",))
    discovered = discover_hosts(script) if script and chosen == "horovodrun" else None
    job = _Job(np, command, hosts, hostfile, host_list, gloo, list(launcher_args), env, thread_vars, str(find(chosen)),
               network_interfaces, discovered)
    return _BUILDERS[chosen](job)


def discover_hosts(script: str, timeout_s: float = 10) -> Optional[List[Tuple[str, int]]]:
    """The hosts an elastic job's discovery script names now (as horovodrun runs it: a shell command), or None.

    None when it fails or prints nothing readable: the hosts are then unknown.
    """
    try:
        result = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout_s)
        found = parse_hosts(",".join(result.stdout.split())) if result.returncode == 0 else []
    except (subprocess.TimeoutExpired, OSError, LaunchError):
        return None
    return found or None


def _beside(name: str, python: str, environ: Mapping[str, str]) -> Optional[str]:
    """``name`` next to the interpreter (a virtual environment's bin), else on PATH."""
    candidate = os.path.join(os.path.dirname(python), name)
    return candidate if os.access(candidate, os.X_OK) else find_executable(name, environ)


@dataclass(frozen=True)
class _Job:
    """Everything a launcher's command line is built from."""

    np: int
    program: List[str]
    hosts: Optional[str]
    hostfile: Optional[str]
    host_list: List[Tuple[str, int]]
    gloo: bool
    extra: List[str]
    environ: Mapping[str, str]
    thread_vars: Dict[str, str]
    path: str
    network_interfaces: Optional[str] = None
    discovered: Optional[List[Tuple[str, int]]] = None

    @property
    def elastic_discovery(self) -> bool:
        """True when a host discovery script names the hosts (elastic horovodrun): they are not known here."""
        return _given(self.extra, "--host-discovery-script")

    @property
    def single_host(self) -> bool:
        """True only when every rank is known to run on this host (an elastic job: its script names only this one)."""
        if self.elastic_discovery:
            return self.discovered is not None and _is_local(self.discovered)
        return _is_local(self.host_list)

    def interface_env(self) -> Dict[str, str]:
        """What NCCL reads for its interfaces (Gloo's come from horovodrun's own option)."""
        return {"NCCL_SOCKET_IFNAME": self.network_interfaces} if self.network_interfaces else {}


def _horovodrun(job: _Job) -> Launch:
    interfaces, notes = job.network_interfaces, []
    if _given(job.extra, "--network-interface"):
        interfaces = None  # the user's own, through --launcher-arg
    elif interfaces is None and job.single_host:
        # On one host Horovod otherwise probes every interface; elastic runs then hang silently.
        interfaces = "lo"
        notes = ["the host discovery script names only this host now: --network-interfaces lo (pass "
                 "--network-interfaces when it will name others)" if job.elastic_discovery else "one host: --network-interfaces lo"]
    elif interfaces is None and job.elastic_discovery:
        notes = ["the host discovery script names other hosts (or failed): no --network-interfaces lo; "
                 "pass --network-interfaces naming the interface between them"]
    command = horovodrun_command(job.np, [], job.hosts, job.hostfile, job.gloo, interfaces, horovodrun=job.path)
    if job.elastic_discovery:
        # Elastic: the script names the hosts, and horovodrun refuses -H beside it.
        at = command.index("-H")
        del command[at:at + 2]
    return Launch("horovodrun", command + job.extra + job.program, job.thread_vars, notes)


def _mpirun(job: _Job) -> Launch:
    slots = sum(s for _, s in job.host_list) if job.host_list else os.cpu_count() or 1
    oversubscribe = _is_local(job.host_list) and job.np > slots
    export = list(THREAD_VARIABLES) + [name for name in _PASSED_ON if name in job.environ] + list(job.interface_env())
    notes = [f"{job.np} processes on {slots} slots: --oversubscribe"] if oversubscribe else []
    command = mpirun_command(job.np, [], job.hosts, job.hostfile, export, oversubscribe,
                             network_interfaces=job.network_interfaces, mpirun=job.path)
    return Launch("mpirun", command + job.extra + job.program, {**job.thread_vars, **job.interface_env()}, notes)


def _srun(job: _Job) -> Launch:
    if job.host_list:
        raise LaunchError("srun takes its hosts from the SLURM allocation; drop -H/--hostfile "
                          "or choose --launcher horovodrun or mpirun")
    cpus = job.environ.get("SLURM_CPUS_PER_TASK", "")
    command = [job.path] + srun_command(job.np, [], int(cpus) if cpus.isdigit() else None)[1:]
    nodes = job.environ.get("SLURM_JOB_NUM_NODES") or job.environ.get("SLURM_NNODES") or ""
    if nodes.isdigit() and job.np % int(nodes) == 0:
        command.append(f"--ntasks-per-node={job.np // int(nodes)}")
    # One failed rank ends the step instead of leaving the others waiting in a collective.
    command.append("--kill-on-bad-exit=1")
    # srun hands the whole environment to the ranks; Open MPI's library reads its MCA settings there.
    interfaces = {"OMPI_MCA_btl_tcp_if_include": job.network_interfaces} if job.network_interfaces else {}
    return Launch("srun", command + job.extra + job.program, {**job.thread_vars, **interfaces, **job.interface_env()}, [])


_BUILDERS = {"horovodrun": _horovodrun, "mpirun": _mpirun, "srun": _srun}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` subcommand's arguments; everything after the script goes to the script."""
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="processes to start")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", default=None, help="hosts and slots, e.g. node1:4,node2:4 (default: this host)")
    where.add_argument("--hostfile", default=None, help="a file of 'host slots=N' or 'host:N' lines")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                        help="default: srun in a SLURM allocation, else horovodrun, else mpirun")
    parser.add_argument("--mpi", dest="gloo", action="store_false", help="horovodrun with MPI instead of Gloo")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads per process (default: the node's cores shared by its processes)")
    parser.add_argument("--launcher-arg", dest="launcher_args", action="append", default=[],
                        help="an extra argument for the launcher itself, e.g. --launcher-arg=--mpi=pmix (repeatable)")
    parser.add_argument("--network-interfaces", default=None, metavar="IFACE[,IFACE]",
                        help="interfaces between the hosts, e.g. eth0 or ib0,eth0 (default: the one the hosts "
                             "share, when there is exactly one; lo on this host alone)")
    parser.add_argument("--no-host-check", dest="host_check", action="store_false",
                        help="start without first asking each other host through ssh / the rsh agent")
    parser.add_argument("--dry-run", action="store_true", help="print the command, start nothing")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="script.py and its arguments")


def main_from_args(args: argparse.Namespace) -> int:
    """``main`` with the parsed ``run`` arguments."""
    return main(args.np, args.program, args.dry_run, args.host_check, launcher=args.launcher, hosts=args.hosts,
                hostfile=args.hostfile, gloo=args.gloo, threads=args.threads, launcher_args=args.launcher_args,
                network_interfaces=args.network_interfaces)


def _other_hosts(options: Mapping[str, object]) -> List[str]:
    """Every host of the job when some are not this one (they are asked before launch), else none."""
    host_list = parse_hosts(options.get("hosts"), options.get("hostfile"))  # type: ignore[arg-type]
    return [] if _is_local(host_list) else [host for host, _ in host_list]


def _interfaces_chosen(launcher_args: Sequence[str]) -> bool:
    return (_given(launcher_args, "--network-interface") or "btl_tcp_if_include" in launcher_args
            or "OMPI_MCA_btl_tcp_if_include" in os.environ)


def check_hosts(job: Launch, hosts: Sequence[str], np: int, program: Sequence[str],
                options: Mapping[str, object]) -> Tuple[Launch, List[str]]:
    """Ask every host through the launcher's agent; refuse the ones that do not answer, pass the shared interface.

    Returns:
        The launch (re-planned with ``--network-interfaces`` when the hosts share exactly one) and the agent.

    Raises:
        HostUnreachableError: naming each host that did not answer and ssh's reason.
    """
    launcher_args = list(options.get("launcher_args") or ())  # type: ignore[call-overload]
    agent = remote.remote_agent(job.launcher, launcher_args, os.environ, lambda name: find_executable(name))
    reports = remote.probe(hosts, agent)
    message = remote.unreachable_message(reports, job.launcher)
    if message:
        raise remote.HostUnreachableError(message)
    if options.get("network_interfaces") or _interfaces_chosen(launcher_args):
        return job, agent
    choice = remote.choose_interfaces(reports)
    if not choice.interfaces:
        return Launch(job.launcher, job.command, job.env, job.notes + [choice.reason]), agent
    chosen = plan_launch(np, program, **{**options, "network_interfaces": ",".join(choice.interfaces)})  # type: ignore[arg-type]
    note = f"--network-interfaces {','.join(choice.interfaces)}: {choice.reason}"
    return Launch(chosen.launcher, chosen.command, chosen.env, chosen.notes + [note]), agent


def main(np: int, program: Sequence[str], dry_run: bool = False, host_check: bool = True, **options: object) -> int:
    """Print the launch line; unless ``dry_run``, replace this process with it (exit code passes through).

    With other hosts (unless ``host_check`` is off) each is asked first (``check_hosts``); mpirun then
    runs as a child, so that a failed start is explained by naming the hosts that no longer answer.
    """
    hosts: List[str] = []
    agent: List[str] = []
    try:
        job = plan_launch(np, program, **options)  # type: ignore[arg-type]
        hosts = _other_hosts(options) if host_check and job.launcher != "srun" else []
        if hosts:
            job, agent = check_hosts(job, hosts, np, program, options)
    except DualframeError as error:
        print(f"dualframe run: {error}", file=sys.stderr)
        return 2
    for note in job.notes:
        print(f"# {note}", file=sys.stderr)
    print(job.shell(), flush=True)
    if dry_run:
        return 0
    env = dict(os.environ, **job.env)
    if job.launcher == "mpirun" and _other_hosts(options):
        return watch.run(job.command, env, lambda: _explain(hosts or _other_hosts(options), agent, job, options))
    os.execvpe(job.command[0], job.command, env)
    return 0  # not reached


def _explain(hosts: Sequence[str], agent: List[str], job: Launch, options: Mapping[str, object]) -> str:
    """Why Open MPI could not start its daemons: the hosts that do not answer now, or what else to check."""
    if not agent:
        launcher_args = list(options.get("launcher_args") or ())  # type: ignore[call-overload]
        agent = remote.remote_agent(job.launcher, launcher_args, os.environ, lambda name: find_executable(name))
    message = remote.unreachable_message(remote.probe(hosts, agent), job.launcher)
    return message or (f"every host answers through the remote agent now ({', '.join(hosts)}): check that orted is "
                       "on PATH there and that --network-interfaces names an interface every host can reach")

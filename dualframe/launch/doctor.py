"""`dualframe doctor`: what is installed, what the Horovod build supports, where this process stands, and the job's hosts.

Given hosts (``-H n1:1,n2:1`` or ``--hostfile``), it asks each through the agent ``dualframe run``'s
launcher would use (``dualframe.launch.remote``) and reports its interfaces and addresses, and the
interface ``dualframe run`` would pass, or that you should pass one with ``--network-interfaces``.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

from dualframe.launch import remote
from dualframe.launch.commands import find_executable
from dualframe.launch.topology import detect

FIX = "bash scripts/bootstrap.sh"

# Each probe runs in its own interpreter: torch and TensorFlow never share a process, and a broken
# framework cannot take the doctor down with it.
_BUILD_FLAGS = (
    "flags = {n: bool(getattr(hvd, n + '_built')()) for n in "
    "('mpi', 'gloo', 'nccl', 'cuda', 'rocm', 'ddl', 'ccl')}\n"
)
_PROBES = {
    "torch": (
        "import json, torch\nout = {'version': torch.__version__, "
        "'devices': [f'cuda:{i}' for i in range(torch.cuda.device_count())]}\n"
        "import horovod, horovod.torch as hvd\n" + _BUILD_FLAGS +
        "out.update(horovod=horovod.__version__, build=flags)\nprint(json.dumps(out))\n"
    ),
    "tensorflow": (
        "import os; os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')\n"
        "import json, tensorflow as tf, keras\nout = {'version': tf.__version__, 'keras': keras.__version__, "
        "'devices': [d.name.replace('/physical_device:', '/') for d in tf.config.list_physical_devices()]}\n"
        "import horovod, horovod.tensorflow as hvd\n" + _BUILD_FLAGS +
        "out.update(horovod=horovod.__version__, build=flags)\nprint(json.dumps(out))\n"
    ),
    "mpi4py": (
        "import json, mpi4py\nmpi4py.rc.initialize = False\nfrom mpi4py import MPI\n"
        "print(json.dumps({'version': mpi4py.__version__, 'library': MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()}))\n"
    ),
}


def _probe(name: str, python: str) -> Dict[str, Any]:
    try:
        result = subprocess.run([python, "-c", _PROBES[name]], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "timed out after 180 s"}
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return {"ok": False, "error": lines[-1] if lines else f"exit {result.returncode}"}
    return {"ok": True, **json.loads(result.stdout.strip().splitlines()[-1])}


def _mpirun() -> Dict[str, Any]:
    path = find_executable("mpirun")
    if path is None:
        return {"ok": False, "error": "mpirun not found on PATH"}
    result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    first = (result.stdout or result.stderr).strip().splitlines()
    return {"ok": result.returncode == 0, "path": path, "version": first[0] if first else ""}


def _beside_python(name: str, python: str) -> Optional[str]:
    """``name`` from the interpreter's own bin folder (a virtual environment's), else from PATH."""
    candidate = os.path.join(os.path.dirname(python), name)
    return candidate if os.access(candidate, os.X_OK) else find_executable(name)


def hosts_report(hosts: Sequence[str], launcher: str, launcher_args: Sequence[str] = ()) -> Dict[str, Any]:
    """Each host's answer through ``launcher``'s remote agent and the interface they share, as plain data.

    Example:
        >>> report = hosts_report(["localhost"], "horovodrun")
        >>> report["hosts"][0]["reachable"], report["choice"]["interfaces"]
        (True, ['lo'])
    """
    try:
        agent = remote.remote_agent(launcher, launcher_args, os.environ, find_executable)
    except remote.HostUnreachableError as error:
        return {"launcher": launcher, "agent": [], "hosts": [], "unreachable": str(error),
                "choice": {"interfaces": [], "reason": "no remote agent", "networks": []}}
    reports = remote.probe(hosts, agent)
    choice = remote.choose_interfaces(reports)
    return {"launcher": launcher, "agent": agent, "hosts": [asdict(report) for report in reports],
            "choice": {"interfaces": list(choice.interfaces), "reason": choice.reason, "networks": list(choice.networks)},
            "unreachable": remote.unreachable_message(reports, launcher)}


def gather(python: Optional[str] = None, hosts: Sequence[str] = (), launcher: str = "horovodrun",
           launcher_args: Sequence[str] = ()) -> Dict[str, Any]:
    """Collect the doctor's report as plain data (what ``--json`` prints); ``hosts`` adds their report."""
    python = python or sys.executable
    topo = detect()
    extra = {"hosts": hosts_report(hosts, launcher, launcher_args)} if hosts else {}
    return {**extra,
        "python": {"version": platform.python_version(), "executable": python},
        "torch": _probe("torch", python),
        "tensorflow": _probe("tensorflow", python),
        "mpi": {"mpirun": _mpirun(), "mpi4py": _probe("mpi4py", python)},
        "horovodrun": _beside_python("horovodrun", python),
        "topology": asdict(topo),
    }


def problems(report: Dict[str, Any], required: Sequence[str]) -> List[str]:
    """What keeps dualframe from being usable, each with the command that fixes it."""
    found = []
    frameworks = [name for name in ("torch", "tensorflow") if report[name]["ok"]]
    if not frameworks:
        found.append(f"no framework works with Horovod (torch: {report['torch'].get('error')}; "
                     f"tensorflow: {report['tensorflow'].get('error')}); fix: {FIX}")
    for name in required:
        if name in ("torch", "tensorflow") and not report[name]["ok"]:
            found.append(f"{name} with Horovod is required but failed: {report[name].get('error')}; fix: {FIX}")
    for name in frameworks:
        build = report[name]["build"]
        if not (build["mpi"] or build["gloo"]):
            found.append(f"Horovod for {name} has neither MPI nor Gloo built in; fix: {FIX}")
    if not report["mpi"]["mpirun"]["ok"] and not any(report[n]["ok"] and report[n]["build"]["gloo"] for n in frameworks):
        found.append("no launcher: mpirun is missing and Horovod has no Gloo; fix: apt-get install openmpi-bin libopenmpi-dev")
    if report.get("hosts", {}).get("unreachable"):
        found.append(report["hosts"]["unreachable"])
    return found


def render_hosts(hosts: Dict[str, Any]) -> List[str]:
    """The hosts' part of the report: one line per host, then the interface ``dualframe run`` would pass."""
    lines = [f"hosts       through {hosts['launcher']}'s agent: {' '.join(hosts['agent'])}"]
    for host in hosts["hosts"]:
        report = remote.HostReport(host["host"], host["reachable"], host["error"],
                                   tuple(remote.Interface(**i) for i in host["interfaces"]), host["local"])
        lines.append(f"  {report.host:<9} {'(this host) ' if report.local else ''}{report.describe()}")
    choice = hosts["choice"]
    if choice["interfaces"]:
        lines.append(f"interface   {','.join(choice['interfaces'])}: {choice['reason']}; dualframe run passes "
                     f"--network-interfaces {','.join(choice['interfaces'])}")
    else:
        lines.append(f"interface   none chosen: {choice['reason']}")
    return lines


def render(report: Dict[str, Any], issues: Sequence[str]) -> str:
    """The report as readable text."""
    lines = [f"python      {report['python']['version']} ({report['python']['executable']})"]
    for name in ("torch", "tensorflow"):
        probe = report[name]
        if not probe["ok"]:
            lines.append(f"{name:<11} MISSING: {probe['error']}")
            continue
        extra = f", keras {probe['keras']}" if "keras" in probe else ""
        built = ", ".join(k for k, v in probe["build"].items() if v) or "nothing"
        lines.append(f"{name:<11} {probe['version']}{extra}; horovod {probe['horovod']} built with: {built}")
        lines.append(f"{'':<11} devices: {', '.join(probe['devices']) or 'none'}")
    mpirun, mpi4py = report["mpi"]["mpirun"], report["mpi"]["mpi4py"]
    lines.append(f"mpirun      {mpirun.get('version') or mpirun.get('error')}")
    lines.append(f"mpi4py      {mpi4py.get('version', '')} {mpi4py.get('library') or mpi4py.get('error', '')}".rstrip())
    lines.append(f"horovodrun  {report['horovodrun'] or 'not found'}")
    t = report["topology"]
    lines.append(f"launcher    {t['launcher']}: rank {t['rank']}/{t['size']}, local {t['local_rank']}/{t['local_size']}, "
                 f"cross {t['cross_rank']}/{t['cross_size']}")
    lines += render_hosts(report["hosts"]) if "hosts" in report else []
    lines += [f"PROBLEM: {p}" for p in issues] or ["usable: yes"]
    return "\n".join(lines)


def main(as_json: bool = False, required: Sequence[str] = (), hosts: Sequence[str] = (),
         launcher: str = "horovodrun", launcher_args: Sequence[str] = ()) -> int:
    """Print the report; return 0 when dualframe is usable (and every host answers), 1 otherwise."""
    report = gather(hosts=hosts, launcher=launcher, launcher_args=launcher_args)
    issues = problems(report, required)
    if as_json:
        print(json.dumps({**report, "usable": not issues, "problems": issues}, indent=2))
    else:
        print(render(report, issues))
    return 1 if issues else 0

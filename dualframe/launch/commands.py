"""Launcher command lines (horovodrun, mpirun, srun) and the thread settings that avoid oversubscription."""
from __future__ import annotations

import os
import shutil
from typing import Dict, List, Mapping, Optional, Sequence

from dualframe.errors import StrategyError

#: Variables every launched process should see so np processes do not fight over the cores.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def thread_env(processes_per_node: int, cores: Optional[int] = None) -> Dict[str, str]:
    """Thread counts that give each of ``processes_per_node`` processes its share of the cores.

    Example:
        >>> thread_env(2, cores=2)["OMP_NUM_THREADS"]
        '1'
    """
    if processes_per_node < 1:
        raise StrategyError(f"processes_per_node must be >= 1 (processes_per_node: {processes_per_node})")
    cores = cores or os.cpu_count() or 1
    per_process = str(max(1, cores // processes_per_node))
    return {
        "OMP_NUM_THREADS": per_process,
        "MKL_NUM_THREADS": per_process,
        "TF_NUM_INTRAOP_THREADS": per_process,
        "TF_NUM_INTEROP_THREADS": "1",
    }


def _check_np(np: int) -> None:
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise StrategyError(f"-np must be an int >= 1 (np: {np!r})")


def horovodrun_command(
    np: int,
    program: Sequence[str],
    hosts: Optional[str] = None,
    hostfile: Optional[str] = None,
    gloo: bool = True,
    network_interfaces: Optional[str] = None,
    horovodrun: str = "horovodrun",
) -> List[str]:
    """``horovodrun`` command line for ``program`` on ``np`` processes (Gloo unless ``gloo=False``).

    Example:
        >>> horovodrun_command(2, ["python", "train.py"])
        ['horovodrun', '-np', '2', '-H', 'localhost:2', '--gloo', 'python', 'train.py']
    """
    _check_np(np)
    command = [horovodrun, "-np", str(np)]
    if hostfile:
        command += ["--hostfile", hostfile]
    else:
        command += ["-H", hosts or f"localhost:{np}"]
    command.append("--gloo" if gloo else "--mpi")
    if network_interfaces:
        command += ["--network-interfaces", network_interfaces]
    return command + list(program)


def mpirun_command(
    np: int,
    program: Sequence[str],
    hosts: Optional[str] = None,
    hostfile: Optional[str] = None,
    export: Sequence[str] = THREAD_VARIABLES,
    oversubscribe: bool = False,
    as_root: Optional[bool] = None,
    network_interfaces: Optional[str] = None,
    mpirun: str = "mpirun",
) -> List[str]:
    """Open MPI ``mpirun`` command line; ``export`` names variables passed on with ``-x``.

    ``network_interfaces`` (``eth0`` or ``ib0,eth0``; Open MPI also takes subnets) limits both MPI's
    TCP traffic and Open MPI's own out-of-band channel to those interfaces.

    Example:
        >>> mpirun_command(2, ["python", "train.py"], export=(), as_root=False)
        ['mpirun', '-np', '2', '--bind-to', 'none', '--map-by', 'slot', 'python', 'train.py']
    """
    _check_np(np)
    command = [mpirun]
    if as_root if as_root is not None else (hasattr(os, "geteuid") and os.geteuid() == 0):
        command.append("--allow-run-as-root")
    if oversubscribe:
        command.append("--oversubscribe")
    command += ["-np", str(np)]
    if hostfile:
        command += ["--hostfile", hostfile]
    elif hosts:
        command += ["-H", hosts]
    if network_interfaces:
        # The out-of-band channel too: left to itself it may pick an interface the other nodes cannot reach.
        command += ["--mca", "btl_tcp_if_include", network_interfaces, "--mca", "oob_tcp_if_include", network_interfaces]
    # Binding to cores fights the framework's own thread pools; slots fill one node first.
    command += ["--bind-to", "none", "--map-by", "slot"]
    for name in export:
        command += ["-x", name]
    return command + list(program)


def srun_command(np: int, program: Sequence[str], cpus_per_task: Optional[int] = None) -> List[str]:
    """``srun`` command line inside a SLURM allocation (PMIx/PMI2 picks the ranks)."""
    _check_np(np)
    command = ["srun", f"--ntasks={np}"]
    if cpus_per_task:
        command.append(f"--cpus-per-task={cpus_per_task}")
    return command + list(program)


def find_executable(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Path of ``name`` on PATH, or None."""
    path = (environ or os.environ).get("PATH")
    return shutil.which(name, path=path)
